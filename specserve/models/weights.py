"""Checkpoint tensors into our models' fused parameters: HF's q/k/v projections stack into one
`qkv_proj`, gate/up into one `gate_up_proj` (llama.py, gemma3.py); every parameter must be filled."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

STACKED = {  # HF name fragment -> (our param fragment, shard index)
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def load_stacked_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...) into `model`'s parameters
    (its `cfg` gives the stacked sizes; a tied model skips lm_head.weight); a tensor with no place,
    a wrong shape or a parameter left unfilled is an error naming it."""
    params = dict(model.named_parameters())
    cfg = model.cfg
    kv = cfg.num_kv_heads * cfg.head_dim
    sizes = {"self_attn.qkv_proj": [cfg.num_heads * cfg.head_dim, kv, kv],
             "mlp.gate_up_proj": [cfg.intermediate_size] * 2}
    expected: set[str] = set()
    for n in params:
        frag = _stacked_fragment(n, sizes)
        expected |= {f"{n}#{i}" for i in range(len(sizes[frag]))} if frag else {n}
    loaded: set[str] = set()
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding serves as lm_head
        target, shard = name, None
        for frag, (ours, index) in STACKED.items():
            if frag in name:
                target, shard = name.replace(frag, ours), index
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
        if shard is not None:
            part = sizes[_stacked_fragment(target, sizes)]
            offset = sum(part[:shard])
            param, target = param[offset:offset + part[shard]], f"{target}#{shard}"
        if param.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(target)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0].split('#')[0]!r}")


def _stacked_fragment(param_name: str, sizes: dict[str, list[int]]) -> str | None:
    return next((frag for frag in sizes if frag in param_name), None)
