"""Engine API behaviour a user would notice: errors, abort, seeds, stop rules, async streams."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from specserve import LLM, SamplingParams
from specserve.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64,
               block_size=4)


def test_missing_and_corrupt_model_dirs_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="model not found"):
        LLM(str(tmp_path / "nope"), device="cpu")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path), device="cpu")


def test_corrupt_weights_are_a_clear_error(tiny_llama_dir, tmp_path):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read weights"):
        LLM(str(d), device="cpu", dtype="float32")


def test_cli_errors_are_one_liners(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "hi", "--model",
                           str(tmp_path / "missing")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"specserve: error: model not found: {tmp_path / 'missing'} "
                                                "(give a HF model directory, a .gguf file, or a hub id org/name)"]
    assert "Traceback" not in proc.stderr


def test_prompt_longer_than_max_model_len_is_refused(llm):
    with pytest.raises(ValueError, match="does not fit max_model_len 128"):
        llm.generate([list(range(3, 200))], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 99999]], SamplingParams(max_tokens=4))
    assert llm.engine.kv_manager.pool.num_used_blocks == 0


def test_output_stops_at_max_model_len(llm):
    out = llm.generate([list(range(3, 120))], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 128
    assert out.outputs[0].finish_reason == "length"


def test_seeded_sampling_reproducible_even_with_preemption(tiny_llama_dir):
    prompts = [[3 + i, 7, 9, 11 + i] * (3 + i) for i in range(6)]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=20, ignore_eos=True)
              for i in range(6)]
    roomy = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=256, block_size=4)
    tight = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=20, block_size=4)
    a = [o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params)]
    b = [o.outputs[0].token_ids for o in tight.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert a == b
    assert len({tuple(x) for x in a}) > 1


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    ids = greedy.outputs[0].token_ids
    stop_at = ids[3]
    first = ids.index(stop_at)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == ids[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at


def test_abort_frees_blocks(llm):
    eng = llm.engine
    eng.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.kv_manager.pool.num_used_blocks > 0
    eng.abort("a")
    eng.step()
    assert eng.kv_manager.pool.num_used_blocks == 0 and not eng.has_unfinished()


def test_async_engine_streams_and_cancel_frees_blocks(llm):
    engine = AsyncEngine(llm.engine)

    async def main():
        got = []
        async for out in engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)):
            got.append(len(out.outputs[0].token_ids))
        assert got[-1] == 12 and got == sorted(got) and len(got) > 1
        # leave a stream early: the request is aborted and its blocks freed
        agen = engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await agen.aclose()
        for _ in range(200):
            if engine.stats()["num_used_blocks"] == 0 and engine.stats()["num_requests_running"] == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats()["num_used_blocks"] == 0
        with pytest.raises(ValueError):
            async for _ in engine.generate([], SamplingParams()):
                pass

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_auto_dtype_follows_the_cpu(tiny_llama_dir):
    from specserve.models.loader import cpu_has_fast_bf16, resolve_dtype
    from specserve.models.registry import load_arch_config
    arch = load_arch_config(tiny_llama_dir / "config.json")
    import torch
    assert resolve_dtype("float16", arch, torch.device("cpu")) == torch.float16
    assert resolve_dtype("auto", arch, torch.device("cuda")) == torch.bfloat16
    expected = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    assert resolve_dtype("auto", arch, torch.device("cpu")) == expected


def test_threads_sets_the_cpu_threads_of_generation(tiny_llama_dir):
    """`threads` / --threads: torch's CPU threads for the engine's math (a real process, so the
    suite's own thread count is untouched); a bad value is a one-line error."""
    code = ("import torch, sys; from specserve import LLM, SamplingParams; "
            f"llm = LLM({str(tiny_llama_dir)!r}, dtype='float32', device='cpu', num_kv_blocks=16, threads=1); "
            "llm.generate({'prompt_token_ids': [5, 6]}, SamplingParams(max_tokens=2)); "
            "print(torch.get_num_threads())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "1"
    bad = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "hi", "--model", str(tiny_llama_dir),
                          "--threads", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip() == "specserve: error: threads must be at least 1, got 0"


def test_tokenizer_from_another_directory(tiny_llama_dir, tmp_path):
    """`tokenizer=` (vLLM's --tokenizer): the model's own dir has none; text prompts then work."""
    from tests.server.harness import add_char_tokenizer

    tok_dir = add_char_tokenizer(tiny_llama_dir, tmp_path / "with-tokenizer")
    plain = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=16)
    assert plain.tokenizer is None
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=16, tokenizer=str(tok_dir))
    out = llm.generate("abc", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("abc") and len(out.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="no tokenizer files"):
        LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=16, tokenizer=str(tmp_path))


def test_max_num_batched_tokens_defaults_by_device(tiny_llama_dir):
    """Left open, the step's token budget comes from the device (big chunks on a GPU); given, it is kept."""
    import torch

    from specserve.config import EngineConfig
    from specserve.engine.build import DEFAULT_MAX_NUM_BATCHED_TOKENS, with_device_defaults

    open_config = EngineConfig()
    for kind in ("cpu", "cuda"):
        resolved = with_device_defaults(open_config, torch.device(kind))
        assert resolved.scheduler.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS[kind]
    assert open_config.scheduler.max_num_batched_tokens is None  # the caller's config is left alone
    assert DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"] > DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=16)
    assert llm.engine.config.scheduler.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"]
    given = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=16, max_num_batched_tokens=96)
    assert given.engine.config.scheduler.max_num_batched_tokens == 96
