"""Dataclasses that cross seams: scheduler -> runner -> scheduler, and engine -> user."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.request import Request


DRAFT_PLACEHOLDER = -1  # a draft the host does not have yet (its value is on the device): never a model input


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens before this step: first position computed
    num_tokens: int  # tokens computed this step, spec tokens included
    spec_token_ids: list[int]  # drafts verified this step (the last len() tokens of the chunk)
    block_ids: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample (and verify drafts)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    finished_req_ids: set[str] = field(default_factory=set)  # runner may drop their state
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    # req_id -> tokens to append (accepted drafts + one sampled/bonus token); only for sampled requests
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> per appended token {token_id: logprob} (sampled token + top-n), when asked for
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # req_id -> draft tokens to verify next step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> number of drafts accepted this step (only for requests that verified drafts)
    num_accepted: dict[str, int] = field(default_factory=dict)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    time_to_first_token: float | None = None
    num_preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
