"""nf4 on CPUs with AVX512-BF16: bitsandbytes repacks 4-bit weights for its fused CPU kernel on the
first forward, and that repacking fails on shapes its tiles do not divide. Our layers keep the packed
path only where it fits; these tests pin the rule on every CPU (the conversion itself is plain torch)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve.quant import NF4

bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")

from specserve.quant.bnb import cpu_packed_layout_fits, quantize_linear  # noqa: E402

# (out_features, in_features): the tiny test models' projections and the default model's
SHAPES = [(64, 96), (192, 64), (96, 64), (64, 64), (1536, 576), (576, 1536), (40, 64)]


def _nf4(out_features: int, in_features: int, monkeypatch, avx512bf16: bool) -> nn.Module:
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: avx512bf16)
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False)
    return quantize_linear(linear, NF4, torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_packed_path_only_where_its_layout_fits(out_features, in_features, monkeypatch):
    q = _nf4(out_features, in_features, monkeypatch, avx512bf16=True)
    fits = out_features % 32 == 0 and in_features % 64 == 0
    assert cpu_packed_layout_fits(out_features, in_features) is fits
    assert q.support_avx512bf16_for_cpu is fits
    state = q.weight.quant_state
    if fits:  # bnb's repacking holds these shapes and inverts exactly
        packed, packed_state = F._convert_weight_packed_for_cpu(q.weight.data.clone(), state)
        data, back = F._convert_weight_packed_for_cpu_inverse(packed, packed_state)
        assert torch.equal(data, q.weight.data)
    else:  # the failure seen on AVX512-BF16 machines, which our layer now never reaches
        with pytest.raises((RuntimeError, AssertionError)):
            F._convert_weight_packed_for_cpu(q.weight.data.clone(), state)


@pytest.mark.parametrize("out_features,in_features", [(64, 96), (40, 64)])
def test_unfit_shapes_compute_on_the_plain_path(out_features, in_features, monkeypatch):
    """Where the packed layout does not fit, the layer runs bnb's plain 4-bit matmul even on a CPU
    that reports AVX512-BF16, and matches the same layer on a CPU without it."""
    x = torch.randn(3, in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = _nf4(out_features, in_features, monkeypatch, avx512bf16=True)(x)
        ref = _nf4(out_features, in_features, monkeypatch, avx512bf16=False)(x)
    assert torch.equal(got, ref)
    assert not getattr(_nf4(out_features, in_features, monkeypatch, True).weight.quant_state,
                       "packing_format_for_cpu", False)
