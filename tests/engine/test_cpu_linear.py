"""Linear layers on the CPU through oneDNN (models/layers/cpu_linear.py): the same products as
nn.functional.linear, a row's result independent of the rest of the batch, and an engine on the CPU
that runs every linear layer (and its LM heads) packed, with the same greedy text."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve import LLM, SamplingParams
from specserve.models.layers.cpu_linear import ENV_SWITCH, MIN_PACKED_ELEMENTS, PackedLinear, pack_linears

DTYPES = [torch.float32] + ([torch.bfloat16] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else [])
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [0, 1, 2, 5, 17, 64])
def test_packed_linear_computes_what_torch_does(dtype, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    w = torch.randn(96, 80, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(num_tokens, 120, generator=gen).to(dtype)[:, 10:90]  # not contiguous, as hidden[:, :h]
    for bias in (None, b):
        got = PackedLinear(w, bias)(x)
        want = nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert got.shape == (num_tokens, 96) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("shape", [(576, 576), (576, 1536), (1536, 576)], ids=str)
def test_a_row_does_not_depend_on_the_rest_of_the_batch(shape):
    """In fp32 a token's product is the same bits whether it is computed alone or with up to 64 others,
    so a verification's rows equal what one-token decoding computes (torch's BLAS does not promise this).
    (576, 1536) is the default model's MLP down projection: on AVX-512 CPUs oneDNN sums a lone row of
    it in another order unless PackedLinear runs it as two."""
    gen = torch.Generator().manual_seed(0)
    layer = PackedLinear(torch.randn(*shape, generator=gen))
    x = torch.randn(65, shape[1], generator=gen)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(torch.stack([layer(row) for row in x]), alone)  # a 1-d row too
    for m in (2, 3, 5, 9, 17, 33, 65):
        assert torch.equal(layer(x[:m]), alone[:m]), m


def test_pack_linears_swaps_every_large_linear_and_the_tied_head():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(600, 512)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512, bias=False))
                                        for _ in range(2))
            self.small = nn.Linear(512, 16)  # below MIN_PACKED_ELEMENTS: oneDNN's call overhead would not pay
            self.lm_head = None  # tied, as the models say it

    model = Tiny()
    x = torch.randn(3, 512)
    want = [blk(x) for blk in model.blocks] + [nn.functional.linear(x, model.embed_tokens.weight)]
    assert pack_linears(model) == 5
    assert type(model.small) is nn.Linear and model.small.weight.numel() < MIN_PACKED_ELEMENTS
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 5
    got = [blk(x) for blk in model.blocks] + [model.lm_head(x)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert model.embed_tokens.weight.shape == (600, 512)  # the embedding keeps its rows


def test_the_switch_leaves_linears_to_torch(monkeypatch):
    monkeypatch.setenv(ENV_SWITCH, "torch")
    model = nn.Sequential(nn.Linear(1024, 1024))
    assert pack_linears(model) == 0 and type(model[0]) is nn.Linear


def test_a_cpu_engine_runs_packed_with_the_same_greedy_text(default_model_dir, monkeypatch):
    """The real default model in fp32: every linear layer and the tied LM head packed, and the same
    greedy tokens as the engine with torch's linear (the products differ in the last bits only)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    packed = LLM(str(default_model_dir), dtype="float32")
    model = packed.engine.runner.target.model
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params)]
    del packed
    monkeypatch.setenv(ENV_SWITCH, "torch")
    plain = LLM(str(default_model_dir), dtype="float32")
    assert plain.engine.runner.target.model.lm_head is None
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert got == want


def test_an_eagle_head_on_the_cpu_runs_packed(default_model_dir):
    from specserve.spec_decode.eagle_head import EagleHead

    llm = LLM(str(default_model_dir), dtype="float32",  # the shipped head
              speculative_config={"method": "eagle", "num_speculative_tokens": 3})
    head = next(ex.model for ex in llm.engine.runner.executors if isinstance(ex.model, EagleHead))
    assert isinstance(head.fc, PackedLinear) and isinstance(head._lm_head_layer, PackedLinear)
    assert head.dtype == torch.float32
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=16, temperature=0))
    assert len(out[0].outputs[0].token_ids) > 0
