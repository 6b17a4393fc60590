"""Draft models for the speculative tests: tiny Llamas sharing the target's vocabulary."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import build_tiny_model

VOCAB = 320  # the tiny llama's


@pytest.fixture(scope="session")
def noisy_draft_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The target's weights plus noise: a draft that agrees often but not always."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("draft-noisy")
    for f in tiny_llama_dir.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(5)
    for f in tiny_llama_dir.glob("*.safetensors"):
        tensors = load_file(str(f))
        noisy = {k: (v + 0.03 * torch.randn(v.shape, generator=gen) if v.ndim == 2 else v).contiguous()
                 for k, v in tensors.items()}
        save_file(noisy, str(out / f.name), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def small_draft_dir(tmp_path_factory) -> Path:
    """An unrelated 1-layer Llama with the same vocabulary (accepts little)."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("draft-1layer"), seed=2, num_hidden_layers=1)


@pytest.fixture(scope="session")
def seed1_draft_dir(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("draft-seed1"), seed=1)


def spec_prompts(num: int = 8, seed: int = 0) -> list[list[int]]:
    """Mixed lengths; every other prompt starts with the same 24-token "system prompt" (prefix-cache
    hits) and each repeats a piece of itself (so n-gram lookup finds drafts)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(24)]
    lengths = [5, 17, 33, 1, 64, 9, 40, 23, 12, 50][:num]
    prompts = []
    for i, n in enumerate(lengths):
        body = [rng.randrange(3, VOCAB) for _ in range(n)]
        prompts.append((system if i % 2 == 0 else []) + body + body[:8])
    return prompts


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine spinning OpenMP
    threads make them 10-100x slower."""
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)


@pytest.fixture(scope="session")
def fused_head_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The same, fusing the target's layer 0 with its final hidden state (method eagle3)."""
    from tests.spec_decode.test_eagle import train_tiny_head

    return train_tiny_head(tiny_llama_dir, tmp_path_factory.mktemp("fused-head"), aux_layers=(0,))
