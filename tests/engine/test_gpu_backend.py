"""On a GPU: the triton backend (with and without CUDA graphs) gives the torch backend's greedy output."""
from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def run(model_dir, **kw):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 17, 33, 1, 64, 9, 40, 23)]
    prompts.append(prompts[4][:48] + [7, 8, 9])  # a prefix-cache hit with a partial block
    llm = LLM(str(model_dir), dtype="float32", device="cuda", num_kv_blocks=512, max_model_len=256, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("chunk", [2048, 16])
def test_triton_matches_torch_greedy_fp32(tiny_model_dir, eager, chunk):
    expected, _ = run(tiny_model_dir, attention_backend="torch", max_num_batched_tokens=chunk)
    got, llm = run(tiny_model_dir, attention_backend="triton", enforce_eager=eager, max_num_batched_tokens=chunk)
    assert (llm.engine.runner.graphs is None) == eager
    assert got == expected


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_greedy_on_gpu_graphs_matches_torch(tiny_llama_dir, method):
    """Verification steps (1 + k tokens per request) and draft decode steps replayed from CUDA graphs."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(tiny_llama_dir)  # draft = target: every draft accepted
    expected, _ = run(tiny_llama_dir, attention_backend="torch")
    got, llm = run(tiny_llama_dir, attention_backend="triton", speculative_config=spec)
    assert llm.engine.runner.graphs is not None
    assert got == expected


def recorded_replays(graphs) -> list[int]:
    """The max query length of every step `graphs` replays from now on."""
    replayed, run_graph = [], graphs.run

    def run(input_ids, positions, meta, key, *args, **inputs):
        replayed.append(meta.max_query_len)
        return run_graph(input_ids, positions, meta, key, *args, **inputs)

    graphs.run = run
    return replayed


def test_one_request_prefills_replay_graphs_greedy_fp32(tiny_model_dir):
    """One request at a time: its prompt (or what the prefix cache leaves of it) runs through the graph
    of the next prefill length, padded. Same greedy tokens as the torch backend."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 17, 30, 64, 65, 100, 200, 450)]
    prompts.append(prompts[7][:400] + [7, 8, 9])  # a prefix-cache hit: a few new tokens over a long context
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results, replayed = {}, []
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_model_dir), dtype="float32", device="cuda", attention_backend=backend, max_num_seqs=1,
                  num_kv_blocks=512, max_model_len=512)
        if backend == "triton":
            assert llm.engine.runner.graphs.prefill_lens[-1] == 512
            replayed = recorded_replays(llm.engine.runner.graphs)
        results[backend] = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
    assert results["triton"] == results["torch"]
    # every prompt, and the hit's new tokens, replayed a prefill graph
    prefills = [q for q in replayed if q > 1]
    assert prefills[:8] == [5, 17, 30, 64, 65, 100, 200, 450] and len(prefills) == 9 and prefills[8] < 16
