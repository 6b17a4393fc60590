"""N-gram prompt lookup, the adaptive-k policy, and the speculative config / CLI flags."""
from __future__ import annotations

import numpy as np
import pytest

from specserve.cli import build_parser, engine_kwargs
from specserve.config import SpecConfig, engine_config_from_args
from specserve.spec_decode.adaptive import AdaptiveK
from specserve.spec_decode.ngram import find_ngram_drafts


def drafts(tokens, k=3, min_n=1, max_n=4):
    return find_ngram_drafts(np.array(tokens, dtype=np.int64), min_n, max_n, k)[0].tolist()


# -- n-gram lookup -------------------------------------------------------------------------------
def test_longest_match_wins():
    # suffix [7, 8] occurs at 1-2 (followed by 1 2 3) and [8] alone at 6 (followed by 9 9 9)
    tokens = [0, 7, 8, 1, 2, 3, 8, 9, 9, 9, 5, 7, 8]
    assert drafts(tokens) == [1, 2, 3]
    assert find_ngram_drafts(np.array(tokens), 1, 4, 3)[1] == 2  # the match length


def test_most_recent_of_equal_matches_with_full_continuation():
    assert drafts([4, 1, 1, 1, 4, 2, 2, 2, 4]) == [2, 2, 2]
    assert drafts([4, 1, 1, 1, 4, 2, 4], k=3) == [1, 1, 1]  # the later 4 has only 2 tokens after it
    assert drafts([4, 2, 4], k=3) == [2, 4]  # no full continuation anywhere: the most recent, short


def test_no_match_or_too_short():
    assert drafts([1, 2, 3, 4]) == []
    assert drafts([5]) == []
    assert drafts([1, 2, 3, 9, 2, 3], min_n=3) == []  # only a 2-gram repeats
    assert drafts([1, 2, 3, 9, 1, 2, 3], min_n=3) == [9, 1, 2]


def test_k_limits_and_zero():
    assert drafts([1, 2, 3, 4, 5, 6, 1], k=2) == [2, 3]
    assert drafts([1, 2, 3, 4, 5, 6, 1], k=0) == []


def test_long_context_is_fast_enough():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=8000)
    import time
    t = time.perf_counter()
    for _ in range(50):
        find_ngram_drafts(tokens, 1, 4, 5)
    assert (time.perf_counter() - t) / 50 < 5e-3


# -- adaptive k ----------------------------------------------------------------------------------
def test_fixed_k_when_not_adaptive():
    policy = AdaptiveK(5, adaptive=False)
    assert policy.plan({"a": 10, "b": 2, "c": 0}, 3, 100) == {"a": 5, "b": 2, "c": 0}


def test_k_follows_acceptance():
    policy = AdaptiveK(5, compute_bound_tokens=16)
    for _ in range(10):
        policy.observe("good", 5, 5)
        policy.observe("bad", 5, 0)
    ks = policy.plan({"good": 10, "bad": 10}, 2, 100)
    assert ks["good"] == 5 and ks["bad"] == 0
    assert policy.acceptance("good") > 0.9 > 0.2 > policy.acceptance("bad")


def test_no_speculation_once_the_batch_is_compute_bound():
    policy = AdaptiveK(4, compute_bound_tokens=16)
    rooms = {f"r{i}": 10 for i in range(32)}
    assert set(policy.plan(rooms, 32, 2048).values()) == {0}
    few = policy.plan({f"r{i}": 10 for i in range(2)}, 2, 2048)
    assert all(k > 0 for k in few.values())


def test_draft_cost_shortens_k():
    cheap, dear = AdaptiveK(8, compute_bound_tokens=64), AdaptiveK(8, compute_bound_tokens=64, draft_cost=0.4)
    for p in (cheap, dear):
        for _ in range(10):
            p.observe("r", 4, 3)
    assert dear.plan({"r": 10}, 1, 100)["r"] < cheap.plan({"r": 10}, 1, 100)["r"]


def test_resting_requests_drift_back_to_the_prior():
    policy = AdaptiveK(4, compute_bound_tokens=8)
    for _ in range(10):
        policy.observe("r", 4, 0)
    assert policy.plan({"r": 10}, 1, 100)["r"] == 0
    for _ in range(30):
        policy.plan({"r": 10}, 1, 100)
    assert policy.plan({"r": 10}, 1, 100)["r"] > 0  # tried again


def test_plan_is_deterministic_and_respects_budget():
    policy = AdaptiveK(4, compute_bound_tokens=1000)
    rooms = {f"r{i}": 10 for i in range(8)}
    assert policy.plan(rooms, 8, 10) == policy.plan(rooms, 8, 10)
    assert sum(policy.plan(rooms, 8, 10).values()) <= 10


# -- config and CLI ------------------------------------------------------------------------------
def test_cli_flags_build_the_spec_config():
    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'])
    spec = engine_config_from_args(**engine_kwargs(args)).spec
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 5, 3)
    args = parser.parse_args(["generate", "hi", "--draft-model", "/m/draft", "--num-speculative-tokens", "2",
                              "--draft-load-format", "dummy"])
    spec = engine_config_from_args(**engine_kwargs(args)).spec
    assert (spec.method, spec.model, spec.num_speculative_tokens, spec.load_format) == \
        ("draft_model", "/m/draft", 2, "dummy")
    assert engine_config_from_args(**engine_kwargs(parser.parse_args(["generate", "hi"]))).spec is None


def test_bad_spec_configs_are_refused():
    with pytest.raises(ValueError, match="not valid JSON"):
        SpecConfig.parse("{method: ngram}")
    with pytest.raises(ValueError, match="unknown speculative_config keys: bogus"):
        SpecConfig.parse({"method": "ngram", "bogus": 1})
    with pytest.raises(ValueError, match="needs a draft model"):
        SpecConfig(method="draft_model")
    with pytest.raises(ValueError, match="simulated_acceptance"):
        SpecConfig(simulated_acceptance=1.5)
    with pytest.raises(ValueError, match="compute_bound_tokens"):
        SpecConfig(compute_bound_tokens=0)


def test_the_draft_steps_cost_is_shared_by_the_batch():
    """One draft forward serves every drafting request: at 16 requests a head costing 3.5% of a
    target step still drafts (each request alone could not pay for the draft steps), and the
    plan still goes to k = 0 when the batch is large enough for verification to cost compute."""
    policy = AdaptiveK(4, compute_bound_tokens=128, draft_cost=0.035, prior=0.8)
    ks = policy.plan({f"r{i}": 100 for i in range(16)}, 16, 8192)
    assert min(ks.values()) >= 2
    assert policy.worth_trying(16, 16)
    assert set(policy.plan({f"r{i}": 100 for i in range(512)}, 512, 8192).values()) == {0}


def test_a_request_without_room_does_not_end_the_plan():
    """The best request has no room for drafts (its max_tokens is reached): the others still draft."""
    policy = AdaptiveK(4, compute_bound_tokens=128, draft_cost=0.035, prior=0.8)
    for _ in range(5):
        policy.observe("full", 4, 4)
    ks = policy.plan({"full": 0, "a": 10, "b": 10}, 3, 100)
    assert ks["full"] == 0 and ks["a"] > 0 and ks["b"] > 0
