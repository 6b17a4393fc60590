"""Gemma 3 on a tiny random Gemma3-shaped model (window 8, shorter than the prompts): logits and greedy
output equal HF transformers' in fp32, with prefill chunked into 16-token steps and prefix-cache hits;
both config.json generations parse to the same model."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.executor import ModelExecutor
from specserve.models.layers.attention import get_attention_backend
from specserve.models.loader import load_model
from specserve.models.registry import parse_arch_config
from tests.conftest import TINY_SHAPES, build_tiny_model, hf_greedy

PROMPTS = [[5, 17, 42, 99, 7, 3], list(range(20, 60)), [5, 17, 42, 99, 7, 3, 250, 11, 8, 8, 31, 2, 77, 140]]


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    return build_tiny_model("gemma3", tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def hf_gemma3(tiny_gemma3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_gemma3_dir), dtype=torch.float32).eval()


def test_logits_match_transformers_at_every_position(tiny_gemma3_dir, hf_gemma3):
    # 40 positions through 3 local layers (window 8) and a global one, softcapped logits
    cpu = torch.device("cpu")
    loaded = load_model(str(tiny_gemma3_dir), dtype="float32", device=cpu)
    assert type(loaded.model).__name__ == "Gemma3ForCausalLM"
    assert loaded.arch.layer_windows == [8, 8, None, 8]
    executor = ModelExecutor(loaded.model, get_attention_backend("torch", cpu), cpu, torch.float32, 4, 16)
    ids = PROMPTS[1]
    with torch.no_grad():
        ours = executor.compute_logits(executor.forward_tokens(ids, [len(ids)], [len(ids)], [list(range(10))]))
        ref = hf_gemma3(torch.tensor([ids])).logits[0].float()
    assert ref.abs().max() <= 3.0  # the softcap is on
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_hits(tiny_gemma3_dir):
    expected = hf_greedy(tiny_gemma3_dir, PROMPTS, 12)
    llm = LLM(str(tiny_gemma3_dir), dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=16,
              block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    again = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params)[0]  # shares blocks with its first run
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == expected[2]


def test_ngram_speculation_with_steps_left_in_flight(tiny_gemma3_dir):
    """Steps left in flight (async scheduling, adaptive k idle) ask the target for no aux outputs; a
    model without aux layers runs them as any other step."""
    args = dict(dtype="float32", device="cpu", num_kv_blocks=64)
    llm = LLM(str(tiny_gemma3_dir), **args, async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}, {"prompt_token_ids": [9, 10, 11, 12]}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.stats()["num_deferred_steps"] > 0
    plain = LLM(str(tiny_gemma3_dir), **args)
    assert out == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]


def test_legacy_and_current_config_fields_parse_alike():
    # transformers 5 writes layer_types and per-layer-type rope_parameters; older Gemma 3 files carry
    # sliding_window_pattern, rope_theta, rope_local_base_freq and a rope_scaling for the global layers
    current = dict(TINY_SHAPES["gemma3"], num_hidden_layers=6,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"])
    legacy = {k: v for k, v in current.items() if k not in ("layer_types", "rope_parameters")}
    legacy.update(sliding_window_pattern=6, rope_theta=50_000.0, rope_local_base_freq=10_000.0,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    a, b = parse_arch_config(current), parse_arch_config(legacy)
    for field in ("layer_windows", "rope_theta", "local_rope_theta", "query_pre_attn_scalar",
                  "final_logit_softcapping", "qk_norm"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.layer_windows == [8] * 5 + [None] and a.rope_theta == 50_000.0 and a.local_rope_theta == 10_000.0
    assert a.rope_scaling["factor"] == b.rope_scaling["factor"] == 2.0


@pytest.mark.parametrize("change, message", [
    (dict(attn_logit_softcapping=50.0), "attention logit softcapping"),
    (dict(use_bidirectional_attention=True), "bidirectional"),
    (dict(layer_types=["sliding_attention"]), "layer_types must name"),
    (dict(hidden_activation="silu"), "activation 'silu'"),
])
def test_unsupported_gemma3_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        parse_arch_config(dict(TINY_SHAPES["gemma3"], **change))


def test_multimodal_gemma3_checkpoint_is_refused():
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": dict(TINY_SHAPES["gemma3"], model_type="gemma3_text")}
    with pytest.raises(ValueError, match="unsupported architecture.*Gemma3ForConditionalGeneration"):
        parse_arch_config(raw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["eager", "graphs", "graphs+ngram"])
def test_gpu_triton_backend_and_cuda_graphs_match_transformers(tiny_gemma3_dir, mode):
    # decode (and 1 + k verification) steps past the window replayed from graphs captured once per shape:
    # each layer's window is a constant of the captured kernels
    expected = hf_greedy(tiny_gemma3_dir, PROMPTS, 24)
    spec = {"method": "ngram", "num_speculative_tokens": 3} if "ngram" in mode else None
    llm = LLM(str(tiny_gemma3_dir), dtype="float32", device="cuda", num_kv_blocks=256, max_model_len=256,
              attention_backend="triton", enforce_eager=mode == "eager", speculative_config=spec)
    assert (llm.engine.runner.graphs is None) == (mode == "eager")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_shipped_270m_shape_runs_with_dummy_weights():
    # configs/models/gemma-3-270m.json (older config.json fields): 18 layers, every sixth one global
    llm = LLM("gemma-3-270m", load_format="dummy", dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=8)
    arch = llm.engine.loaded.arch
    assert arch.layer_windows == ([512] * 5 + [None]) * 3 and arch.local_rope_theta == 10_000.0
    out = llm.generate([{"prompt_token_ids": list(range(10, 40))}],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
