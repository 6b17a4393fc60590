"""A request as the scheduler sees it: token ids and progress counters, no tensors."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specserve.sample.structured import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(eq=False)
class Request:
    """Invariant: `num_computed_tokens` (tokens whose KV is in the cache) chases
    `num_tokens + num_pending + len(spec_token_ids)`; every step schedules some of the difference.
    `num_pending`: tokens sampled by a step still in flight (async scheduling): their ids are on the
    device only, so the next step takes them from there and they join `all_token_ids` later."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    owner: str | None = None  # who sent it (a client request or socket): the scheduler's fair share
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 = not admitted yet
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    # SamplingParams.n > 1: the other children, forked from this one when its first token is sampled
    forks: list[Request] = field(default_factory=list)
    # structured outputs: this sample's grammar matcher, set before the request is first scheduled;
    # the scheduler advances it with every output token it appends, and its end ends the request
    grammar: RequestGrammar | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + self.num_pending + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    # -- the request's lifecycle rules: one home for the scheduler, adaptive k and async deferral ----
    def room(self, max_model_len: int, num_new: int = 0) -> int:
        """Tokens the request may still produce after its known tokens, those in flight and `num_new`
        more about to be appended (max_tokens, max_model_len)."""
        ahead = self.num_pending + num_new
        room = max_model_len - self.num_tokens - ahead
        if self.sampling_params.max_tokens is not None:
            room = min(room, self.sampling_params.max_tokens - self.num_output_tokens - ahead)
        return room

    def length_reached(self, max_model_len: int) -> bool:
        """Its known tokens reach max_tokens or max_model_len (tokens in flight not counted)."""
        return self.room(max_model_len, -self.num_pending) <= 0

    def stop_for(self, token_id: int, num_output_tokens: int) -> tuple[RequestStatus, int | None] | None:
        """Whether `token_id`, as output token number `num_output_tokens`, stops the request by eos or a
        stop token id: (status, stop_reason), else None."""
        params = self.sampling_params
        if params.stop_tokens_banned(num_output_tokens):
            return None
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        return None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
