"""Tensor parallelism on the CPU (gloo, real worker processes): greedy fp32 output of TP=2 and TP=4
equals TP=1 token for token with prefix hits, chunked prefill, preemption and n-gram speculation in
one engine; no KV block leaks; a killed worker is a clear error within seconds; no process outlives
the engine (its shutdown, or rank 0 killed)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from specserve import LLM, SamplingParams

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# one engine per TP size runs every case: a 16-token budget chunks the prompts, 40 blocks of 4 tokens
# for 4 sequences force preemption, a shared 24-token prefix and a repeated prompt hit the prefix
# cache, and n-gram speculation (k fixed) verifies drafts in the same batches
ENGINE_ARGS = dict(dtype="float32", device="cpu", threads=1, block_size=4, num_kv_blocks=40, max_num_seqs=4,
                   max_num_batched_tokens=16,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    prefix = [rng.randrange(3, 300) for _ in range(24)]
    pattern = [rng.randrange(3, 300) for _ in range(5)]
    out = [prefix + [rng.randrange(3, 300) for _ in range(n)] for n in (3, 11, 30)]
    out += [pattern * 6, [rng.randrange(3, 300) for _ in range(45)], [17], pattern * 3 + prefix]
    return out + [out[1]]  # the same prompt again: a full prefix hit


def run(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY)
    assert llm.engine.kv_manager.pool.num_used_blocks == 0, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tiny_qwen2_dir) -> dict[str, tuple[list[list[int]], dict]]:
    refs = {}
    for name, path in (("llama", tiny_llama_dir), ("qwen2", tiny_qwen2_dir)):
        llm = LLM(str(path), **ENGINE_ARGS)
        refs[name] = run(llm), llm.engine.stats()
    return refs


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.runner.target.workers.procs.values()]


def assert_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    assert not alive, f"worker processes {alive} outlived the engine"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose (its parent reaps it)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("model,tp", [("qwen2", 4), ("qwen2", 2), ("llama", 2)])
def test_greedy_matches_single_rank(model, tp, reference, tiny_llama_dir, tiny_qwen2_dir, request):
    expected, ref_stats = reference[model]
    assert ref_stats["num_preemptions"] > 0 and ref_stats["prefix_cache_hits"] > 0, "the cases meant to run"
    assert ref_stats["spec_decode_num_accepted_tokens"] > 0
    llm = LLM(str(tiny_llama_dir if model == "llama" else tiny_qwen2_dir), tensor_parallel_size=tp, **ENGINE_ARGS)
    pids = worker_pids(llm)
    assert len(pids) == tp - 1
    try:
        assert run(llm) == expected
        stats = llm.engine.stats()
        for key in ("num_preemptions", "prefix_cache_hits", "spec_decode_num_accepted_tokens"):
            assert stats[key] == ref_stats[key], key  # the same schedule, step for step
        if model == "llama":  # the last use of this engine: kill a worker under it
            _check_killed_worker(llm)
    finally:
        llm.shutdown()
    assert_gone(pids)


def _check_killed_worker(llm: LLM) -> None:
    victim = llm.engine.runner.target.workers.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 .*killed by SIGKILL"):
        run(llm)
    assert time.monotonic() - t0 < 10, "a dead worker must fail the engine within seconds"
    with pytest.raises(RuntimeError, match="rank 1"):  # and every later call, at once
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY)


def test_refused_shapes_and_quantization(tiny_llama_dir):
    with pytest.raises(ValueError, match="must divide the model's KV heads"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=4, device="cpu")
    with pytest.raises(ValueError, match="bitsandbytes weights are not sharded"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, device="cpu", quantization="bitsandbytes-int8")
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=0, device="cpu")


def test_workers_exit_when_rank0_is_killed(tiny_qwen2_dir):
    """Rank 0 SIGKILLed (no shutdown at all): its workers notice and exit on their own."""
    script = textwrap.dedent(f"""
        from specserve import LLM
        if __name__ == "__main__":
            llm = LLM({str(tiny_qwen2_dir)!r}, device="cpu", dtype="float32", threads=1, tensor_parallel_size=2,
                      num_kv_blocks=16)
            print(*[p.pid for p in llm.engine.runner.target.workers.procs.values()], flush=True)
            import time
            time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids, "the engine did not start"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert_gone(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
