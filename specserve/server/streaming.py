"""One request on the engine, seen as a stream of deltas: shared by the WebSocket and HTTP front ends.

Prompts are validated before a stream starts, by the engine's intake (engine/intake.py: coded
`PromptError`s); `RequestStream` runs the request, turns the engine's cumulative `RequestOutput`s
into per-step deltas, and records the request's metrics whatever way it ends (finished, cancelled,
client gone, engine failure).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Literal

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.intake import Prompt
from specserve.engine.outputs import RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

Outcome = Literal["completed", "incomplete", "cancelled", "failed"]


@dataclass(slots=True)
class Delta:
    """What one engine step added to one of the request's samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # set on the sample's last delta: stop | length | abort
    logprobs: list[dict[int, float]] | None = None  # per token of token_ids, when asked for
    # verified draft tokens among token_ids (the request's accepted count since the last delta; with
    # n > 1 counted on the first delta of the step)
    accepted_draft_tokens: int = 0


class RequestStream:
    """Run one request; iterate `deltas()` for per-step deltas. After the stream ends, `outcome`,
    `final` (the last RequestOutput) and `summary()` describe it."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, prompt: Prompt,
                 params: SamplingParams, request_id: str, owner: str | None = None, log: bool = False) -> None:
        self.engine = engine
        self.log = log  # a log line when it ends (--enable-log-requests)
        self.owner = owner  # the socket or HTTP request it belongs to: the scheduler's fair share
        self.metrics = metrics
        self.prompt = prompt  # validated by the intake: the engine takes it as it is
        self.prompt_ids = prompt.token_ids
        self.params = params
        self.request_id = request_id
        self.final: RequestOutput | None = None
        self.outcome: Outcome | None = None
        self.error: str | None = None
        self.num_output_tokens = 0
        self.start = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._first_step_tokens = 0

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """Per-step deltas. Raises ValueError (bad request, before any output) and the engine's
        RuntimeError on failure; leaving early (cancel, disconnect, close) aborts the request."""
        seen_text = [0] * self.params.n
        seen_ids = [0] * self.params.n
        done = [False] * self.params.n
        started = False
        accepted_seen = 0
        try:
            async with aclosing(self.engine.generate(self.prompt, self.params, self.request_id,
                                                          owner=self.owner)) as gen:
                async for out in gen:
                    started = True
                    self.final = out
                    step: list[Delta] = []
                    for o in out.outputs:
                        i = o.index
                        text, ids = o.text[seen_text[i]:], o.token_ids[seen_ids[i]:]
                        lps = o.logprobs[seen_ids[i]:] if o.logprobs is not None else None
                        seen_text[i], seen_ids[i] = len(o.text), len(o.token_ids)
                        if text or ids or (o.finish_reason and not done[i]):
                            done[i] = o.finish_reason is not None
                            step.append(Delta(i, text, list(ids), o.finish_reason, lps))
                    accepted = out.metrics.num_accepted_tokens if out.metrics is not None else 0
                    if step and accepted > accepted_seen:
                        step[0].accepted_draft_tokens, accepted_seen = accepted - accepted_seen, accepted
                    self._observe_step(sum(len(d.token_ids) for d in step), out)
                    yield step
            self.outcome = self._finished_outcome()
        except ValueError:
            if not started:
                self.outcome = None  # rejected: not a request for the metrics
                raise
            self.outcome, self.error = "failed", "the engine rejected the request"
            raise
        except (asyncio.CancelledError, GeneratorExit):
            self.outcome = "cancelled"
            raise
        except Exception as e:
            self.outcome, self.error = "failed", str(e) or type(e).__name__
            raise
        finally:
            self._record()

    def _observe_step(self, num_new: int, out: RequestOutput) -> None:
        if not num_new:
            return
        now = time.monotonic()
        m, name = self.metrics, self.metrics.model_name
        if self.first_token_at is None:
            self.first_token_at = now
            self._first_step_tokens = num_new
            ttft = out.metrics.time_to_first_token if out.metrics else None
            m.ttft.labels(name).observe(ttft if ttft is not None else now - self.start)
        else:
            m.itl.labels(name).observe(now - self.last_token_at)
        self.last_token_at = now
        self.num_output_tokens += num_new
        m.generation_tokens.labels(name).inc(num_new)

    def _finished_outcome(self) -> Outcome:
        reasons = {o.finish_reason for o in self.final.outputs} if self.final else set()
        if "abort" in reasons:
            return "cancelled"
        return "incomplete" if "length" in reasons else "completed"

    def _record(self) -> None:
        if self.outcome is None:
            return
        if self.log:
            self._log()
        m, name = self.metrics, self.metrics.model_name
        m.prompt_tokens.labels(name).inc(len(self.prompt_ids))
        m.request_prompt_tokens.labels(name).observe(len(self.prompt_ids))
        m.request_generation_tokens.labels(name).observe(self.num_output_tokens)
        m.e2e.labels(name).observe(time.monotonic() - self.start)
        timing = self.final.metrics if self.final is not None else None
        if timing is not None and timing.first_scheduled_time is not None:
            m.queue_time.labels(name).observe(max(0.0, timing.first_scheduled_time - timing.arrival_time))
        if self.outcome in ("completed", "incomplete"):
            m.request_success.labels(name, "length" if self.outcome == "incomplete" else "stop").inc()
        elif self.outcome == "cancelled":
            m.request_cancelled.labels(name).inc()
        else:
            m.request_failure.labels(name).inc()
        tpot = self.decode_seconds_per_token()
        if tpot is not None:
            m.tpot.labels(name).observe(tpot)
        m.add_spec(*self.spec_counts())

    def _log(self) -> None:
        outputs = self.final.outputs if self.final is not None else []
        reasons = ",".join(str(o.finish_reason) for o in outputs) or "none"
        ttft = self.ttft_seconds()
        logger.info("request %s (%s): %s, prompt %d tokens (%d cached), output %d tokens, finish %s, "
                    "ttft %s, %.3fs", self.request_id, self.owner, self.outcome, len(self.prompt_ids),
                    self.num_cached_tokens, self.num_output_tokens, reasons,
                    "-" if ttft is None else f"{ttft:.3f}s", time.monotonic() - self.start)

    # -- summaries -------------------------------------------------------------------------------
    def decode_seconds_per_token(self) -> float | None:
        """Mean seconds per output token after the first step's tokens, from the updates' arrival; when
        every token arrived in one update (the engine ran ahead of a busy server loop, which coalesces
        them), from the engine's first-token and finish times."""
        n = self.num_output_tokens - self._first_step_tokens
        if n > 0 and self.first_token_at is not None and self.last_token_at is not None:
            return (self.last_token_at - self.first_token_at) / n
        m = self.final.metrics if self.final else None
        if (m is None or m.first_token_time is None or m.finished_time is None or self.num_output_tokens < 2
                or m.finished_time <= m.first_token_time):
            return None
        return (m.finished_time - m.first_token_time) / (self.num_output_tokens - 1)

    def ttft_seconds(self) -> float | None:
        m = self.final.metrics if self.final else None
        if m is not None and m.time_to_first_token is not None:
            return m.time_to_first_token
        return None if self.first_token_at is None else self.first_token_at - self.start

    def spec_counts(self) -> tuple[int, int, int]:
        """(drafts, draft tokens, accepted tokens) of this request."""
        m = self.final.metrics if self.final else None
        if m is None:
            return 0, 0, 0
        return m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self.final.num_cached_tokens if self.final else 0
