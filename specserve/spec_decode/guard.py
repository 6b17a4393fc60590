"""Closed-loop guard for adaptive k: do drafting steps deliver the speedup the policy predicted?

The policy (specserve/spec_decode/adaptive.py) predicts each step's gain from a cost table and acceptance
estimates. Both can be wrong in ways the policy cannot see: a start-up profile times one request on
a quiet machine (a served batch has batched attention, the rejection sampler, other processes), and
a batch that waits for its slowest request gains less from a few fast requests than the token count
says. So every step reports its wall time, and the guard compares:

- plain steps (no drafts): the recent seconds per unit of modelled cost, per token-count bucket
  (`seconds / costs(num_tokens)`, exact up to 16 tokens, 3 significant bits above);
- drafting steps: the realized speedup, (sampled + accepted) / sampled x plain time / seconds, where
  the plain time is what the same step without drafts would have taken (that unit x costs(base
  tokens)), turned into the accepted tokens that would have given that speedup at the cost the policy
  planned the step at, against the accepted tokens the policy expected of those drafts. `accepted` is
  what the policy passes: the drafts' accepted count (n-gram lookup: the trust then also catches the
  acceptance model overrating all-or-nothing drafts), or, for per-request estimates (a draft model's,
  a head's), the count it expected, so the trust judges the step's cost and not its luck: a few
  steps' accepted counts made it noisy (0.6-1.0 for drafts that paid 1.2x) and, clipped at 1, biased
  low, and adaptive k then drafted in one step of twenty where drafts paid.

`trust(base)` = decayed realized / decayed expected accepted tokens over recent drafting steps of a
batch of that size (power-of-2 buckets), with a prior of a few typical steps pulling it to 1,
clipped to [0, 1];
the policy scales its expected accepted tokens by it. Drafts that do not pay in practice are thus
backed off however the model went wrong. Every step all sums decay, so the trust drifts back to 1
and drafting is tried (and measured) again now and then: it recovers when text gets repetitive.
Conversely, when every step drafts, a plain-step time older than its bucket's age limit is dropped,
and the next steps run without drafts (`wants_probe`) to time a fresh one. The limit starts at
max_age steps and doubles (up to max_age_cap) each time a probe finds the time it replaced within
`steady` of it: a probe costs drafting steps (on an H200 at one request, about three plain steps'
time each, every 70 steps: 3% of a run), and a plain time that holds needs fewer of them.
Pure Python over a few numbers per step; greedy output does not depend on it in fp32 (in bf16 the
shapes of the k it picks can flip near-ties).
"""
from __future__ import annotations

from specserve.utils import round_up_to_bits


def _unit_bucket(num_tokens: int) -> int:
    return num_tokens if num_tokens <= 16 else round_up_to_bits(num_tokens, 3)


def batch_bucket(num: int) -> int:
    """Batch sizes (or token counts) judged together: 1, 2-3, 4-7, 8-15, 16-31, ..."""
    return num.bit_length()


class RealizedGain:
    def __init__(self, *, decay: float = 0.95, unit_decay: float = 0.8, prior_steps: float = 3.0,
                 max_age: int = 64, max_age_cap: int = 512, steady: float = 0.1) -> None:
        """decay: per step, of the gain sums; unit_decay: per plain step, of its bucket's time;
        prior_steps: weight of the prior (trust 1) in drafting steps of the bucket's typical predicted
        gain; max_age: steps after which a plain step's time is too old to compare with, doubled up to
        max_age_cap for a bucket whose fresh times come within `steady` (relative) of the stale ones."""
        self.decay, self.unit_decay, self.prior_steps = decay, unit_decay, prior_steps
        self.max_age, self.max_age_cap, self.steady = max_age, max_age_cap, steady
        self.num_steps = 0
        # bucket -> [seconds per cost unit (EMA), step of last update, steps after which it is stale]
        self._unit: dict[int, list[float]] = {}
        # bucket -> [realized, predicted] gains decayed every step, and the typical predicted gain of
        # a drafting step (an average over drafting steps only: the prior's scale)
        self._gain: dict[int, list[float]] = {}
        self._unjudged: dict[int, int] = {}  # unit bucket -> drafting steps since its plain time went stale

    def observe(self, num_base_tokens: int, base_cost: float, seconds: float, num_sampled: int,
                num_accepted: int, num_draft_tokens: int, predicted_accepted: float = 0.0,
                cost_ratio: float = 1.0, tick: bool = True) -> float | None:
        """A step over `num_base_tokens` tokens (modelled cost `base_cost`) plus `num_draft_tokens`
        drafts took `seconds`; `num_sampled` requests sampled and accepted `num_accepted` drafts;
        `predicted_accepted`: the accepted tokens the policy expected of those drafts, at a modelled
        step cost of `cost_ratio` x the plain step's. `tick`: the observation is a step of its own.
        Returns a drafting step's realized speedup over the plain step (None: not judged)."""
        if tick:
            self.tick()
        if seconds <= 0 or base_cost <= 0:
            return None
        bucket = _unit_bucket(num_base_tokens)
        unit = self._unit.get(bucket)
        if num_draft_tokens == 0:
            self._unjudged.pop(bucket, None)
            per_cost = seconds / base_cost
            if unit is None:
                self._unit[bucket] = [per_cost, self.num_steps, self.max_age]
            elif self.num_steps - unit[1] > unit[2]:
                # too old to anchor this one (a stale time, a compile's, would hold it for good); if
                # it still held, the next one may grow older
                held = abs(per_cost - unit[0]) <= self.steady * unit[0]
                age = min(2 * unit[2], self.max_age_cap) if held else self.max_age
                self._unit[bucket] = [per_cost, self.num_steps, age]
            else:  # an outlier (a page fault, a burst of other work) moves the average by a bounded step
                per_cost = min(max(per_cost, 0.5 * unit[0]), 2.0 * unit[0])
                unit[0] = self.unit_decay * unit[0] + (1 - self.unit_decay) * per_cost
                unit[1] = self.num_steps
            return None
        plain = self.plain_unit(num_base_tokens)
        if plain is None:
            self._unjudged[bucket] = self._unjudged.get(bucket, 0) + 1
            return None
        if num_sampled <= 0 or predicted_accepted <= 0:
            return None
        speedup = (num_sampled + num_accepted) / num_sampled * plain * base_cost / seconds
        realized = (speedup * cost_ratio - 1.0) * num_sampled  # accepted tokens worth that speedup
        sums = self._gain.setdefault(batch_bucket(num_base_tokens), [0.0, 0.0, predicted_accepted])
        sums[0] += max(realized, -float(num_sampled))
        sums[1] += predicted_accepted
        sums[2] = 0.8 * sums[2] + 0.2 * predicted_accepted
        return speedup

    def tick(self) -> None:
        """A step went by (observed, or run without the proposer): the gain sums decay, so a low
        trust drifts back to 1 even while nothing drafts."""
        self.num_steps += 1
        for sums in self._gain.values():
            sums[0] *= self.decay
            sums[1] *= self.decay

    def plain_unit(self, num_base_tokens: int) -> float | None:
        """Seconds per cost unit of recent plain steps over such a batch (None: none recent)."""
        unit = self._unit.get(_unit_bucket(num_base_tokens))
        return unit[0] if unit is not None and self.num_steps - unit[1] <= unit[2] else None

    def wants_probe(self, num_base_tokens: int) -> bool:
        """Should the next step over such a batch run without drafts? Yes after two drafting steps
        that had no recent plain step of their size to be judged against."""
        return self._unjudged.get(_unit_bucket(num_base_tokens), 0) >= 2

    def trust(self, num_base_tokens: int) -> float:
        """The share of predicted gains that drafting steps over such a batch realized (1 = no evidence)."""
        sums = self._gain.get(batch_bucket(num_base_tokens))
        if sums is None:
            return 1.0
        w = self.prior_steps * sums[2]
        return min(max((sums[0] + w) / (sums[1] + w), 0.0), 1.0)
