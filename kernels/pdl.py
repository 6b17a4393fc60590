"""Programmatic dependent launch (PDL) for the project's Triton kernels on Hopper and later GPUs.

A decode step is hundreds of small kernels back to back (in CUDA graphs); each one starts only
after the one before it has drained, so the device idles for the launch and prologue of every
kernel. On sm_90 and later a kernel launched with PDL may be scheduled while the kernel before it
in the stream is still running, and waits for it (`griddepcontrol.wait`: the earlier kernel has
completed and its memory is visible) before it touches memory: the results do not change, the
gap between kernels shrinks.

Each of our kernels takes `PDL: tl.constexpr` and begins with `pdl_prologue(PDL)`: wait for the
kernel before it, then let the next one be scheduled. What keeps it exact: every program of a
kernel launched with PDL waits before its first load or store and before it can end. A kernel
that ended without waiting would let the kernel after it start while the one before was still
writing; so the wait comes ahead of every load, store and early return of every kernel (only an L2
prefetch of weights no kernel writes may come before it: kernels/int8_linear.py). Kernels
that are not ours (cuBLAS, torch's) launch as before: they start after the kernel before them has
completed, and a kernel of ours after them waits for them.

On by default there (on an H100, Llama-3.1-8B shapes at one request: decode steps 1.2% shorter, EAGLE
drafting steps ~1.3%, BENCHMARKS.md 2026-12-07); `SPECSERVE_PDL=0` launches every kernel as before (no
wait compiled in). Elsewhere than a CUDA GPU of compute capability 9.0 or later (Ampere, the Triton
interpreter) PDL is off.
"""
from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

ENV = "SPECSERVE_PDL"
DEFAULT = "1"  # SPECSERVE_PDL when unset
_ON = {"PDL": True, "launch_pdl": True}  # the kernel's constexpr and Triton's launch option
_OFF = {"PDL": False}
_BY_DEVICE: dict[int, dict] = {}
logger = logging.getLogger(__name__)


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Ahead of every load, store and return of every kernel: under PDL, wait for the kernel before (its
    writes visible), then allow the next kernel to be scheduled (it waits in turn)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_enabled(device: torch.device) -> bool:
    """PDL for kernels on `device`: a CUDA GPU of compute capability >= 9.0, not the Triton interpreter,
    and SPECSERVE_PDL (or DEFAULT) not 0 (read once per device and process)."""
    return pdl_args(device) is _ON


def pdl_args(device: torch.device) -> dict:
    """The launch keywords for one of our kernels on `device` (no copy: do not modify)."""
    index = (torch.cuda.current_device() if device.index is None else device.index) if device.type == "cuda" else -1
    args = _BY_DEVICE.get(index)
    if args is None:
        on = (index >= 0 and os.environ.get(ENV, DEFAULT) != "0" and os.environ.get("TRITON_INTERPRET") != "1"
              and torch.cuda.get_device_capability(index)[0] >= 9 and _launches(index))
        args = _BY_DEVICE[index] = _ON if on else _OFF
    return args


@triton.jit
def _probe_kernel(x_ptr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def _launches(index: int) -> bool:
    """Whether this Triton and driver compile, launch and capture in a CUDA graph kernels with PDL, and
    whether they count right (a Triton without the launch option, a driver without the launch attribute
    or its graph edges, raises here): else PDL stays off, logged."""
    if torch.cuda.is_current_stream_capturing():
        return True  # nothing may be launched outside the graph now; the kernels' own launches will tell
    try:
        x = torch.zeros(1, device=torch.device("cuda", index))
        for _ in range(2):
            _probe_kernel[(1,)](x, **_ON)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(2):
                _probe_kernel[(1,)](x, **_ON)
        graph.replay()
        if x.item() != 4:
            raise RuntimeError(f"a probe counted {x.item()}, not 4")
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means: launch as before
        logger.warning("programmatic dependent launch unavailable on cuda:%d (%s: %s); kernels launch without it",
                       index, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
