"""Self-drafts (--draft-model self-nf4 / self-int8): the target's own weights quantized as the
draft, sharing every unquantized tensor, and speculation with it keeps greedy output identical."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import SpecConfig
from specserve.quant import INT8, NF4

bnb = pytest.importorskip("bitsandbytes")
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [11, 12, 30, 40]},
           {"prompt_token_ids": list(range(40, 75))}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_self_draft_names():
    from specserve.quant.self_draft import parse_self_draft

    assert parse_self_draft("self-nf4", None) == NF4
    assert parse_self_draft("self-int8", INT8) == INT8
    assert parse_self_draft("self", NF4) == NF4
    assert parse_self_draft("self", None) is None
    with pytest.raises(ValueError, match="already says bitsandbytes-nf4"):
        parse_self_draft("self-nf4", INT8)
    assert SpecConfig(method="draft_model", model="self-nf4").quantization == NF4


@pytest.mark.parametrize("method", [INT8, NF4])
def test_build_self_draft_shares_the_targets_tensors(tiny_llama_dir, method, monkeypatch):
    from specserve.models.layers.cpu_linear import ENV_SWITCH
    from specserve.quant.self_draft import build_self_draft

    # the engine builds a self-draft before its executors pack linear layers for the CPU; this test
    # builds one from a running engine's model, so that one is left unpacked
    monkeypatch.setenv(ENV_SWITCH, "torch")
    target = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=16)
    model = target.engine.loaded.model
    before = target.generate(PROMPTS, GREEDY)
    draft = build_self_draft(model, method)
    assert draft is not model
    assert draft.embed_tokens.weight is model.embed_tokens.weight
    assert draft.layers[0].input_layernorm.weight is model.layers[0].input_layernorm.weight
    layer_type = bnb.nn.Linear8bitLt if method == INT8 else bnb.nn.Linear4bit
    assert isinstance(draft.layers[1].mlp.down_proj, layer_type)
    assert type(model.layers[1].mlp.down_proj) is torch.nn.Linear  # the target is untouched
    after = target.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    # from a path: loaded again and quantized (no sharing)
    loaded = build_self_draft(tiny_llama_dir, method, device=torch.device("cpu"), dtype="float32")
    assert isinstance(loaded.layers[1].mlp.down_proj, layer_type)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=64)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)], llm.engine.weight_bytes


@pytest.mark.parametrize("draft", ["self-int8", "self-nf4"])
def test_self_draft_speculation_keeps_greedy_output(tiny_model_dir, reference, draft):
    pytest.importorskip("specserve.spec_decode.draft_model", reason="needs the draft-model proposer")
    expected, target_bytes = reference
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=64, draft_model=draft,
              speculative_config={"num_speculative_tokens": 3, "adaptive": False})
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > 0 and accepted > 0
    # the draft adds only its quantized projections (embeddings, norms, lm_head are the target's)
    assert 0 < llm.engine.draft_weight_bytes < 0.35 * target_bytes
    assert llm.engine.weight_bytes == target_bytes + llm.engine.draft_weight_bytes
