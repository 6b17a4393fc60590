"""Messages between a front end and the engine core (engine/core.py).

Into the core: `AddRequest`, `Abort`, `StopSample`, `Shutdown`. Out of it: one `StepOutput` per engine
step carrying every request's new tokens (ids only: text is made on the front end, see
output_processor.py). They are msgspec Structs: encoded as msgpack between processes
(engine/core_process.py), passed as they are within one (the in-thread core and `LLM`).
"""
from __future__ import annotations

import msgspec

from specserve.engine.outputs import RequestMetrics
from specserve.sampling_params import SamplingParams


def sample_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of sample `index` of a request with `n` samples (SamplingParams.n)."""
    return request_id if n == 1 else f"{request_id}#{index}"


class AddRequest(msgspec.Struct, tag="add", array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    owner: str | None
    arrival_time: float  # time.monotonic() on the front end (one clock for all processes of a host)
    client: int = 0  # which front end streams it (--api-server-count)


class Abort(msgspec.Struct, tag="abort", array_like=True, gc=False):
    request_ids: list[str]


class StopSample(msgspec.Struct, tag="stop", array_like=True, gc=False):
    """The front end matched a stop string in a sample's text: the core ends that sample."""

    sample_id: str
    stop: str


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, gc=False):
    pass


CoreInput = AddRequest | Abort | StopSample | Shutdown


class SampleUpdate(msgspec.Struct, array_like=True, gc=False):
    """What one step added to one sample of a request."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" once the sample ended in the core
    stop_reason: int | str | None


class RequestUpdate(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    samples: list[SampleUpdate]  # only the samples with news
    num_cached_tokens: int
    metrics: RequestMetrics


class StepOutput(msgspec.Struct, array_like=True, gc=False):
    updates: list[RequestUpdate] = []
    failed: dict[str, str] = {}  # request id -> why: engine steps with it failed (isolation.py)
    rejected: dict[str, str] = {}  # request id -> why the core refused to add it
    stats: dict | None = None  # LLMEngine.stats() after the step


class ModelInfo(msgspec.Struct, frozen=True):
    """What a front end needs to know about the served model (instead of reaching into the engine)."""

    model: str  # the path or name it was loaded from
    max_model_len: int
    vocab_size: int
    speculative: dict | None  # {method, num_speculative_tokens, draft_model}, None without speculation
    max_logprobs: int = 20  # the most logprobs per token a request may ask for
    # SamplingParams fields -> defaults for requests that leave them out (engine/generation_config.py)
    sampling_defaults: dict = {}
