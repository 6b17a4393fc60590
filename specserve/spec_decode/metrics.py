"""Engine-wide speculative decoding counters (vLLM's spec_decode_* names)."""
from __future__ import annotations

from specserve.engine.outputs import ModelRunnerOutput, SchedulerOutput


class SpecDecodingStats:
    """Drafts verified, draft tokens, accepted tokens, and per draft position: the verifications that
    accepted at least j + 1 drafts (`accepted_per_pos`: gpt-fast's histogram of accepted lengths, as a
    tail sum), and those that judged a draft at position j (`judged_per_pos`: they had a (j + 1)-th
    draft and accepted every draft before it). Their ratio is the conditional acceptance at each
    position, exact also where adaptive k drafted fewer than k: the tail sums alone count a
    verification that accepted its 4 drafts of 4 as one that stopped before a 5th."""

    def __init__(self, max_k: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * max_k
        self.judged_per_pos = [0] * max_k

    def observe(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        for s in sched.scheduled:
            num_accepted = result.num_accepted.get(s.request.request_id)
            if not s.spec_token_ids or num_accepted is None:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += len(s.spec_token_ids)
            self.num_accepted_tokens += num_accepted
            for j in range(num_accepted):
                self.accepted_per_pos[j] += 1
            for j in range(min(num_accepted + 1, len(s.spec_token_ids), len(self.judged_per_pos))):
                self.judged_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verification step: 1 (the target's own token) + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def acceptance_per_position(self) -> list[float | None]:
        """Per draft position: the share of the drafts judged there that were accepted (None: none judged)."""
        return conditional_acceptance(self.accepted_per_pos, self.judged_per_pos)

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_num_judged_tokens_per_pos": list(self.judged_per_pos),
            "spec_decode_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                            if self.num_draft_tokens else None),
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
            "spec_decode_acceptance_per_position": self.acceptance_per_position(),
        }


def conditional_acceptance(accepted_per_pos: list[int], judged_per_pos: list[int]) -> list[float | None]:
    """Per draft position j: the verifications that accepted draft j over those that judged one there
    (`SpecDecodingStats`' counters, or the difference of two readings of them; None: none judged)."""
    return [a / n if n else None for a, n in zip(accepted_per_pos, judged_per_pos)]
