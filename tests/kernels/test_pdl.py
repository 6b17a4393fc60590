"""Programmatic dependent launch (kernels/pdl.py): on where possible (a CUDA GPU of compute capability 9.0 or
later, not the interpreter, SPECSERVE_PDL not 0), off elsewhere; kernels launched with it give
exactly what they give without it, over a CUDA graph's long chains of dependent launches too."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE

from specserve.kernels import pdl
from specserve.kernels.int8_linear import CANDIDATES, int8_linear, int8_linear_config
from specserve.kernels.rms_norm import _rms_norm_kernel, rms_norm
from specserve.quant.int8_rows import quantize_int8_rows


def test_pdl_is_off_on_the_cpu_under_the_interpreter_and_when_switched_off(monkeypatch):
    monkeypatch.setattr(pdl, "_BY_DEVICE", {})
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False} and not pdl.pdl_enabled(torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled(cuda)  # decided without asking the device (there may be none)
    monkeypatch.setattr(pdl, "_BY_DEVICE", {})
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv(pdl.ENV, "0")
    assert not pdl.pdl_enabled(cuda)


def test_the_default_decides_where_the_switch_is_unset(monkeypatch):
    monkeypatch.setattr(pdl, "_BY_DEVICE", {})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(pdl.ENV, raising=False)
    monkeypatch.setattr(pdl, "DEFAULT", "0")
    assert not pdl.pdl_enabled(torch.device("cuda", 0))  # decided without asking the device


@pytest.mark.gpu
def test_gpu_pdl_is_on_from_hopper_and_compiled_into_the_kernels(monkeypatch):
    monkeypatch.setattr(pdl, "_BY_DEVICE", {})
    monkeypatch.setenv(pdl.ENV, "1")
    on = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.pdl_enabled(DEVICE) is on
    x = torch.randn(3, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    compiled = _rms_norm_kernel[(3,)](x, x, w, x, x, 64, 1e-6, 64, 0, 64, 64, HAS_RESIDUAL=False, BLOCK=64,
                                      **pdl.pdl_args(DEVICE))
    assert ("griddepcontrol.wait" in compiled.asm["ptx"]) is on


def _chain(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, config: dict, steps: int
           ) -> torch.Tensor:
    """steps x (an int8 product split over K, a norm with the residual): each launch reads the last one's output."""
    residual = x
    for _ in range(steps):
        y = int8_linear(x, q, s, config=config)
        x, residual = rms_norm(y, w, 1e-6, residual)
    return x + residual


@pytest.mark.gpu
def test_gpu_a_graph_of_dependent_pdl_launches_equals_the_launches_without_pdl(monkeypatch):
    """SPECSERVE_PDL=1: 200 launches, each reading the previous one's output, replayed from a CUDA graph
    with PDL: bit for bit what eager launches without PDL give (a launch that started reading before the
    one before it had written would not)."""
    monkeypatch.setattr(pdl, "_BY_DEVICE", {})
    monkeypatch.setenv(pdl.ENV, "1")
    gen = torch.Generator().manual_seed(0)
    q, s = quantize_int8_rows(torch.randn(512, 512, generator=gen))
    q, s = q.to(DEVICE), s.to(DEVICE)
    w = (1 + 0.1 * torch.randn(512, generator=gen)).to(DEVICE, torch.bfloat16)
    x0 = torch.randn(1, 512, generator=gen).to(DEVICE, torch.bfloat16)
    config = int8_linear_config(1, next(c for c in CANDIDATES if c[3] > 1))
    x = x0.clone()
    _chain(x, q, s, w, config, 2)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _chain(x, q, s, w, config, 100)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setitem(pdl._BY_DEVICE, DEVICE.index or 0, pdl._OFF)
    want = _chain(x0, q, s, w, config, 100)
    assert torch.equal(got, want)
