"""Small torch-free helpers: lazy package attributes (cheap imports), the CLI's byte sizes, and how a
child process ended (`exit_reason`)."""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable
from typing import Any

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def lazy_attributes(package: str, sources: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` (PEP 562) that imports each name of `sources` (name -> module) on first
    use, so that importing `package` (or any module under it) does not load what those names need
    (torch). The value is then stored in the package: later lookups are plain attribute reads."""

    def __getattr__(name: str) -> Any:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def parse_size(value: str) -> int:
    """A byte count with an optional binary unit: '4096', '512M', '2G', '1MiB', '1.5gb'.

    An argparse `type=`: raises ArgumentTypeError, whose message argparse shows as is.
    """
    v = value.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if v and v[-1] in _UNITS:
            return int(float(v[:-1]) * _UNITS[v[-1]])
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {value!r} (e.g. 2G, 512M)") from None


def round_up_to_bits(n: int, bits: int) -> int:
    """The smallest count >= n (n >= 1) with at most `bits` significant bits: 2 ** (bits - 1) buckets per
    doubling, each at most 1 / 2 ** (bits - 1) wider than n (bits 3: 16, 20, 24, 28, 32, 40, ...)."""
    shift = max(n.bit_length() - bits, 0)
    return -(-n >> shift) << shift


def exit_reason(code: int | None) -> str:
    """How a child process ended, from its exit code (None: still running), as a phrase."""
    if code is None:
        return "is not responding"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
