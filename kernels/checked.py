"""A kernel checked against its reference on its first call.

A Triton kernel compiles on the GPU it first runs on, under whatever Triton is installed there; one that
was tested on other GPUs or versions (or only under the interpreter) may fail to compile there, or compute
something else. `FirstUseChecked` wraps such a kernel: its first call outside a CUDA graph capture also
runs the reference (plain PyTorch, or kernels already proven there) and compares the two; a kernel that
raises or disagrees is logged once and the reference serves every later call, so the engine stays correct
(and slower) instead of failing. A first call inside a capture (no warm-up ran before it) runs the kernel
unchecked. Both functions must be pure: the kernel runs twice on its first call.
"""
from __future__ import annotations

import logging
from typing import Any
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class FirstUseChecked:
    def __init__(self, name: str, kernel: Callable, reference: Callable, agree: Callable[[Any, Any], bool]) -> None:
        self.name = name
        self.kernel = kernel
        self.reference = reference
        self.agree = agree
        self.use_kernel: bool | None = None  # None: not yet checked

    def __call__(self, *args, **kwargs):
        if self.use_kernel is None and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self.use_kernel = self._check(args, kwargs)
        return (self.reference if self.use_kernel is False else self.kernel)(*args, **kwargs)

    def _check(self, args: tuple, kwargs: dict) -> bool:
        try:
            got = self.kernel(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of an unproven kernel: the reference serves
            logger.warning("kernel %s failed on its first call (%s: %s); its reference runs instead", self.name,
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return False
        if self.agree(got, self.reference(*args, **kwargs)):
            return True
        logger.warning("kernel %s disagreed with its reference on its first call; the reference runs instead",
                       self.name)
        return False


def all_equal(got: torch.Tensor | tuple, want: torch.Tensor | tuple) -> bool:
    """Tensors (or tuples of them) equal in shape, dtype and every value."""
    if isinstance(got, torch.Tensor):
        got, want = (got,), (want,)
    return len(got) == len(want) and all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))
