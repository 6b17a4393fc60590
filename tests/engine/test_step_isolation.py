"""A step that raises fails only the request that makes it raise: the engine sends everyone back to
recompute, bisects the suspects in steps of their own, ends the culprit, and the other requests
finish with exactly the output of an undisturbed run (greedy, fp32), with no block leaked."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

SHARED = [11, 12, 13, 14, 15, 16, 17, 18]  # a shared prefix: prefix-cache hits between requests
PROMPTS = {f"r{i}": SHARED + [20 + i, 30 + i] * (1 + i % 3) for i in range(7)}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PARAMS = {rid: GREEDY for rid in PROMPTS} | {"r2": SamplingParams(temperature=0.0, n=2, max_tokens=10,
                                                                   ignore_eos=True)}


def engine(tiny_llama_dir, **args):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", **args).engine


def inject(eng, bad: set[str], when: str) -> None:
    """Make every step with a bad request raise: before its work (`before`), only when the bad
    request samples (`sample`: its prefill chunks pass), or after the step's work was done (`after`:
    KV written, tokens sampled, maybe left in flight)."""
    launch = eng.runner.launch

    def faulty(sched, *args, **kwargs):
        hit = [s for s in sched.scheduled if s.request.request_id.split("#")[0] in bad]
        if when == "sample":
            hit = [s for s in hit if s.sample]
        if hit and when != "after":
            raise RuntimeError("injected fault")
        step = launch(sched, *args, **kwargs)
        if hit:
            raise RuntimeError("injected fault")
        return step

    eng.runner.launch = faulty


def run(eng, rids) -> tuple[dict, dict]:
    for rid in rids:
        eng.add_request(rid, {"prompt_token_ids": PROMPTS[rid]}, PARAMS[rid])
    outs, failed = {}, {}
    for _ in range(10_000):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = [(c.token_ids, c.finish_reason) for c in o.outputs]
        failed.update(eng.take_failures())
    assert not eng.has_unfinished()
    return outs, failed


@pytest.mark.parametrize("when", ["before", "sample", "after"])
@pytest.mark.parametrize("engine_args", [dict(), dict(async_scheduling=True),
                                         dict(max_num_batched_tokens=16, num_kv_blocks=24, block_size=4)],
                         ids=["sync", "async", "chunked-tight-kv"])
def test_one_bad_request_fails_alone(tiny_llama_dir, when, engine_args):
    bad = {"r3", "r2"} if when == "sample" else {"r3"}  # r2 has n=2: the whole request fails
    clean, _ = run(engine(tiny_llama_dir, **engine_args), [r for r in PROMPTS if r not in bad])
    eng = engine(tiny_llama_dir, **engine_args)
    inject(eng, bad, when)
    outs, failed = run(eng, list(PROMPTS))
    assert set(failed) == bad and all("injected fault" in why for why in failed.values())
    assert outs == clean  # every other request: the undisturbed output, token for token
    stats = eng.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["num_failed_requests"] == len(bad) and stats["num_failed_steps"] >= 1
    assert not eng.scheduler.isolate
    # the engine goes on serving, prefix cache included
    again, none_failed = run(eng, ["r0", "r5"])
    assert again == {r: clean[r] for r in ("r0", "r5")} and not none_failed


def test_a_fault_that_needs_company_ends_its_request(tiny_llama_dir):
    """A request that fails only next to others passes its solo step; after MAX_FAILED_STEPS failed
    ordinary steps it is ended all the same (no endless retry). Requests that ran beside it in all of
    those steps may end with it; whatever completes has the undisturbed output."""
    clean, _ = run(engine(tiny_llama_dir), list(PROMPTS))
    eng = engine(tiny_llama_dir)
    launch = eng.runner.launch

    def faulty(sched, *args, **kwargs):
        ids = {s.request.request_id for s in sched.scheduled}
        if "r4" in ids and len(ids) > 1:
            raise RuntimeError("fails in company")
        return launch(sched, *args, **kwargs)

    eng.runner.launch = faulty
    outs, failed = run(eng, list(PROMPTS))
    assert "r4" in failed and set(outs) | set(failed) == set(PROMPTS)
    assert all(outs[r] == clean[r] for r in outs)
    assert eng.stats()["num_used_blocks"] == 0


def test_offline_generate_finishes_the_others_then_raises(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu")
    launch = llm.engine.runner.launch

    def by_prompt(sched, *args, **kwargs):
        if any(s.request.prompt_token_ids[:2] == [99, 98] for s in sched.scheduled):
            raise RuntimeError("injected fault")
        return launch(sched, *args, **kwargs)

    llm.engine.runner.launch = by_prompt
    with pytest.raises(RuntimeError, match=r"1 of 3 requests failed \(the others completed\).*injected fault"):
        llm.generate([{"prompt_token_ids": p} for p in ([5, 6, 7], [99, 98, 97], [8, 9])], GREEDY)
    assert llm.engine.stats()["num_used_blocks"] == 0
