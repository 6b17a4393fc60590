"""Tensor parallelism on the CPU (gloo, real worker processes): greedy fp32 output of TP=2 and TP=4
(and one seeded sampling request's) equals TP=1 token for token with prefix hits, chunked prefill,
preemption and speculation (n-gram for the Qwen2 shape, a draft model unsharded on rank 0 for the
Llama shape) in one engine; no KV block leaks; a killed worker and a hung one are clear errors within
seconds; no process outlives the engine (its shutdown, or rank 0 killed)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import dataclasses

import pytest

from specserve import SamplingParams
from specserve.config import ParallelConfig, engine_config_from_args
from specserve.engine.engine import LLMEngine
from specserve.engine.executor import ExecutorDeadError
from tests.conftest import build_tiny_model

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=MAX_NEW, ignore_eos=True)
# one engine per TP size runs every case: a 16-token budget chunks the prompts, 32 blocks of 4 tokens
# for 4 sequences force preemption, a shared 24-token prefix and a repeated prompt hit the prefix
# cache, and speculation (k fixed) verifies drafts in the same batches
ENGINE_ARGS = dict(dtype="float32", device="cpu", threads=1, block_size=4, num_kv_blocks=32, max_num_seqs=4,
                   max_num_batched_tokens=16)
TIMEOUT_S = 10.0  # a collective waiting longer on a worker fails the engine (the hang case)


def engine_args(model: str, model_dir) -> dict:
    spec = {"method": "ngram"} if model == "qwen2" else {"model": str(model_dir)}  # the target as its own draft
    return dict(ENGINE_ARGS, speculative_config=dict(spec, num_speculative_tokens=3, adaptive=False))


def make_engine(model: str, model_dir, tp: int = 1) -> LLMEngine:
    config = engine_config_from_args(model=str(model_dir), tensor_parallel_size=tp, **engine_args(model, model_dir))
    return LLMEngine(dataclasses.replace(config, parallel=ParallelConfig(tp, timeout_s=TIMEOUT_S)))


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    prefix = [rng.randrange(3, 300) for _ in range(24)]
    pattern = [rng.randrange(3, 300) for _ in range(5)]
    out = [prefix + [rng.randrange(3, 300) for _ in range(n)] for n in (3, 11, 30)]
    out += [pattern * 6, [rng.randrange(3, 300) for _ in range(45)], [17], pattern * 3 + prefix]
    return out + [out[1]]  # the same prompt again: a full prefix hit


def run(engine: LLMEngine, batch: list[list[int]] | None = None) -> list[list[int]]:
    batch = batch or prompts()
    # one samples (seeded): the rejection sampler draws over the same logits at every TP size
    ids = [engine.add_request(None, {"prompt_token_ids": p}, SEEDED if i == 3 else GREEDY)
           for i, p in enumerate(batch)]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step(finished_only=True))
    assert not engine.take_failures()
    assert engine.kv_manager.pool.num_used_blocks == 0, "KV blocks leaked"
    return [done[i].outputs[0].token_ids for i in ids]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """The Qwen2 shape (4 KV heads, untied LM head) with a vocabulary of 302: split 4 ways it is padded
    to 4 x 76 rows, so the padding of the embedding and the LM head is exercised too."""
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("tp-qwen2"), vocab_size=302)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, qwen2_dir) -> dict[str, tuple[list[list[int]], dict]]:
    refs = {}
    for name, path in (("llama", tiny_llama_dir), ("qwen2", qwen2_dir)):
        engine = make_engine(name, path)
        refs[name] = run(engine), engine.stats()
    return refs


def worker_pids(engine: LLMEngine) -> list[int]:
    return [p.pid for p in engine.runner.target.workers.procs.values()]


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
def test_greedy_matches_single_rank(model, tp, reference, tiny_llama_dir, qwen2_dir):
    expected, ref_stats = reference[model]
    assert ref_stats["num_preemptions"] > 0 and ref_stats["prefix_cache_hits"] > 0, "the cases meant to run"
    assert ref_stats["spec_decode_num_accepted_tokens"] > 0
    engine = make_engine(model, tiny_llama_dir if model == "llama" else qwen2_dir, tp)
    pids = worker_pids(engine)
    assert len(pids) == tp - 1
    try:
        assert run(engine) == expected
        stats = engine.stats()
        for key in ("num_preemptions", "prefix_cache_hits", "spec_decode_num_accepted_tokens"):
            assert stats[key] == ref_stats[key], key  # the same schedule, step for step
        # the last use of each TP=2 engine: a worker killed under it, or one that hangs
        if (model, tp) == ("llama", 2):
            _check_failed_worker(engine, signal.SIGKILL, r"tensor-parallel worker rank 1 .*killed by SIGKILL", 10)
        elif (model, tp) == ("qwen2", 2):
            _check_failed_worker(engine, signal.SIGSTOP, r"timed out after 10s: a worker hangs", TIMEOUT_S + 10)
    finally:
        engine.shutdown()
    assert_gone(pids)


def _check_failed_worker(engine: LLMEngine, sig: signal.Signals, message: str, within: float) -> None:
    os.kill(engine.runner.target.workers.procs[1].pid, sig)
    t0 = time.monotonic()
    with pytest.raises(ExecutorDeadError, match=message):
        run(engine)
    assert time.monotonic() - t0 < within, "a failed worker must fail the engine within seconds, not hang it"
    with pytest.raises(ExecutorDeadError, match=message):  # and every later step, at once
        run(engine, [[5, 6, 7]])
    for req_id in list(engine.groups):
        engine.abort(req_id)
    assert engine.kv_manager.pool.num_used_blocks == 0


def test_refused_shapes_and_quantization(tiny_llama_dir):
    from specserve import LLM

    with pytest.raises(ValueError, match="must divide the model's KV heads"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=4, device="cpu")
    with pytest.raises(ValueError, match="bitsandbytes weights are not sharded"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, device="cpu", quantization="bitsandbytes-int8")
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=0, device="cpu")
    with pytest.raises(ValueError, match="self-draft"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, device="cpu", draft_model="self-int8")


def test_gemma3_refused_with_a_reason():
    from specserve.distributed.sharding import check_tensor_parallel
    from specserve.models.registry import parse_arch_config
    from tests.conftest import TINY_SHAPES

    arch = parse_arch_config(dict(TINY_SHAPES["gemma3"], num_hidden_layers=4))
    with pytest.raises(ValueError, match="Gemma3ForCausalLM runs with tensor_parallel_size 1"):
        check_tensor_parallel(arch, 2)


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


@pytest.mark.parametrize("aux_layers", [(), (0,)], ids=["last-hidden", "fused"])
def test_eagle_head_under_tensor_parallelism(qwen2_dir, tmp_path, aux_layers):
    """An EAGLE head runs whole on rank 0 over a target split 2 ways (its embedding and untied, padded
    LM head are read back whole from the checkpoint): the output equals TP=1's, drafts verified; a
    head that fuses a target layer reads it from rank 0's forward."""
    import torch

    from specserve.models.registry import load_arch_config
    from specserve.spec_decode.eagle_head import EagleHead, head_config, save_head

    arch = load_arch_config(qwen2_dir / "config.json")
    torch.manual_seed(0)
    head = EagleHead(head_config(arch), 512, torch.arange(arch.vocab_size), aux_layers=aux_layers)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.normal_(1.0, 0.1)
    head_dir = save_head(head, tmp_path / "head")
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 3, "adaptive": False}

    def engine(tp: int) -> LLMEngine:
        config = engine_config_from_args(model=str(qwen2_dir), tensor_parallel_size=tp,
                                         **dict(ENGINE_ARGS, speculative_config=spec))
        return LLMEngine(dataclasses.replace(config, parallel=ParallelConfig(tp, timeout_s=TIMEOUT_S)))

    single = engine(1)
    expected, stats = run(single), single.stats()
    assert stats["spec_decode_num_drafts"] > 0
    split = engine(2)
    pids = worker_pids(split)
    try:
        assert run(split) == expected
        assert split.stats()["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_accepted_tokens"]
    finally:
        split.shutdown()
    assert_gone(pids)
