"""Token updates -> RequestOutputs: detokenization and stop strings, on the front end.

The engine core reports token ids only (messages.RequestUpdate). Turning them into text runs here,
beside whoever reads the outputs (`LLM`, or the server process), so the core's step loop does no
per-token string work and several server processes share that work (--api-server-count). A stop
string found here ends the sample at once for the reader; the caller tells the core
(`messages.StopSample`), which may have computed a few more tokens by then: they are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.intake import Prompt
from specserve.engine.messages import RequestUpdate, sample_id
from specserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from specserve.sampling_params import SamplingParams


@dataclass(slots=True)
class _Sample:
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _Tracked:
    prompt: Prompt
    n: int
    samples: list[_Sample]
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    """Tracks the requests a reader waits on: `process(update)` takes the core's tokens in (and says
    which samples a stop string ended); `output(request_id)` builds the request's cumulative
    RequestOutput, only when someone reads it (a reader that falls behind costs no copies)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Tracked] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = []
        for _ in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt.token_ids, params.stop_strings,
                                               params.include_stop_str_in_output, params.skip_special_tokens)
            samples.append(_Sample(detok, logprobs=[] if params.logprobs is not None else None))
        self._requests[request_id] = _Tracked(prompt, params.n, samples)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(self, update: RequestUpdate) -> tuple[bool, list[tuple[str, str]]]:
        """Apply one update. Returns whether the request is now finished (False if it is not tracked:
        aborted, or removed) and the (sample id, stop string) pairs the core must end."""
        tracked = self._requests.get(update.request_id)
        if tracked is None:
            return False, []
        tracked.num_cached_tokens, tracked.metrics = update.num_cached_tokens, update.metrics
        stops = []
        for u in update.samples:
            s = tracked.samples[u.index]
            if s.finish_reason is not None:
                continue  # ended here by a stop string: the core's later tokens are dropped
            s.token_ids.extend(u.token_ids)
            if s.logprobs is not None and u.logprobs:
                s.logprobs.extend(u.logprobs)
            stop = s.detok.add_tokens(u.token_ids) if s.detok is not None else None
            if stop is not None:
                s.finish_reason, s.stop_reason = "stop", stop
                if u.finish_reason is None:
                    stops.append((sample_id(update.request_id, u.index, tracked.n), stop))
            elif u.finish_reason is not None:
                s.finish_reason, s.stop_reason = u.finish_reason, u.stop_reason
            if s.finish_reason is not None and s.detok is not None:
                s.detok.flush()
        return tracked.finished, stops

    def output(self, request_id: str) -> RequestOutput:
        """The request's cumulative output now; a finished request is forgotten once it is built."""
        tracked = self._requests[request_id]
        finished = tracked.finished
        if finished:
            del self._requests[request_id]
        outputs = []
        for i, s in enumerate(tracked.samples):
            text = ""
            if s.detok is not None:
                s.detok.take_delta()
                text = s.detok.text[:s.detok.emitted]
            outputs.append(CompletionOutput(index=i, text=text, token_ids=list(s.token_ids),
                                            finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                            logprobs=list(s.logprobs) if s.logprobs is not None else None))
        prompt = tracked.prompt
        return RequestOutput(request_id=request_id, prompt=prompt.text, prompt_token_ids=prompt.token_ids,
                             outputs=outputs, finished=finished, num_cached_tokens=tracked.num_cached_tokens,
                             metrics=tracked.metrics)
