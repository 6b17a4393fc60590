"""warm_up_paged_attention launches every kernel variant that serving can pick for a head shape, so no
step compiles one (about a second each on a GPU). Checked by recording the launches (their
compile-time parameters) instead of running them: the warm-up's set must contain every variant a
sweep of batches the engine can form (requests, query and context lengths) launches."""
from __future__ import annotations

import importlib

import pytest
import torch

from specserve.kernels import paged_attention, warm_up_paged_attention

pa_module = importlib.import_module("specserve.kernels.paged_attention")

CONSTEXPRS = ("BLOCK_Q", "BLOCK_M", "TILE_N", "NUM_SPLITS", "PER_REQUEST", "SKIP_Q_LEN", "SLIDING",
              "num_warps", "num_stages")


class _Recorder:
    """Stands in for a @triton.jit kernel: records each launch's compile-time parameters."""

    def __init__(self, name: str, seen: set) -> None:
        self.name, self.seen = name, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.add((self.name,) + tuple(kwargs.get(k) for k in CONSTEXPRS))
        return launch


@pytest.fixture
def recorded(monkeypatch):
    seen: set = set()
    for name in ("_paged_attention_kernel", "_paged_attention_reduce_kernel"):
        monkeypatch.setattr(pa_module, name, _Recorder(name, seen))
    return seen


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, dtype, window", [
    (32, 8, 128, torch.bfloat16, None),  # Llama-3.1-8B and its EAGLE head
    (9, 3, 64, torch.bfloat16, None),  # SmolLM2-135M
    (9, 3, 64, torch.float32, None),
    (4, 1, 256, torch.bfloat16, 512),  # sliding-window layers
])
def test_the_warm_up_covers_every_variant_serving_launches(recorded, num_heads, num_kv_heads, head_dim, dtype,
                                                           window):
    block_size, max_model_len = 16, 4096
    warm_up_paged_attention(num_heads, num_kv_heads, head_dim, dtype, block_size, max_model_len, torch.device("cpu"),
                            sliding_windows=(window,))
    warmed = set(recorded)
    assert warmed
    recorded.clear()
    kv = torch.zeros(2, max_model_len // block_size, block_size, num_kv_heads, head_dim, dtype=dtype)
    for num_reqs in (1, 2, 3, 8, 16, 64, 256):
        for q_len in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65, 200):
            for seq_len in (q_len, 100, 300, 1000, 2048, 4096):
                if seq_len < q_len:
                    continue
                query = torch.zeros(num_reqs * q_len, num_heads, head_dim, dtype=dtype)
                starts = torch.arange(num_reqs + 1, dtype=torch.int32) * q_len
                lens = torch.full((num_reqs,), seq_len, dtype=torch.int32)
                tables = torch.zeros(num_reqs, kv.shape[1], dtype=torch.int32)
                paged_attention(query, kv, starts, lens, tables, 1.0, q_len, seq_len, sliding_window=window)
    missing = recorded - warmed
    assert not missing, f"variants serving launches that the warm-up does not: {sorted(missing, key=str)}"
