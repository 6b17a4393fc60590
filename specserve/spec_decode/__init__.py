"""Speculative decoding: proposers (n-gram lookup, draft model), adaptive k, the rejection sampler.

The engine builder makes a proposer with `build_proposer`, binds it (`Proposer.bind`: the executors
it declared a need for), and gives it and a `RejectionSampler` to the model runner, which hands the
proposer plain data every step (`DraftStep`); see proposer.py and docs/speculative.md.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specserve.config import EAGLE_METHODS, SpecConfig
from specserve.models.loader import LoadedModel
from specserve.spec_decode.adaptive import AdaptiveK
from specserve.spec_decode.proposer import DraftStep, Proposer, ProposerBinding
from specserve.spec_decode.rejection import RejectionSampler

if TYPE_CHECKING:
    from specserve.spec_decode.eagle_head import EagleHead

__all__ = ["AdaptiveK", "DraftStep", "Proposer", "ProposerBinding", "RejectionSampler", "build_proposer",
           "check_same_vocab", "default_compute_bound_tokens"]

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def default_compute_bound_tokens(device: torch.device, dtype: torch.dtype) -> int:
    """The target's ridge point in tokens per forward: where reading the weights and computing
    the tokens take equally long (docs/speculative.md). CUDA: ~128 (H200 bf16). CPU, measured on the
    2-core AVX2 machine here with SmolLM2: fp32 ~24; bf16/fp16 ~2 (no native half-precision math:
    every token costs half a step). Override with speculative_config {"compute_bound_tokens": N}."""
    if device.type == "cuda":
        return 128
    return 24 if dtype == torch.float32 else 2


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must speak the target's tokens: same vocabulary size and, when both ship a
    tokenizer, the same token -> id map."""
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(f"draft model {draft.path} has a vocabulary of {draft.arch.vocab_size} tokens but the "
                         f"target {target.path} has {target.arch.vocab_size}: the draft must use the "
                         "target's tokenizer")
    if target.tokenizer is not None and draft.tokenizer is not None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(f"draft model {draft.path} has a different tokenizer than the target "
                             f"{target.path} (same size, other tokens): the draft must use the target's tokenizer")


def build_proposer(spec: SpecConfig, *, target: LoadedModel, device: torch.device, max_positions: int,
                   max_num_batched_tokens: int, seed: int = 0, draft_model=None) -> Proposer:
    """The proposer for `spec`. For a draft model, `draft_model` may be an already-built module of
    our family (e.g. the target's weights quantized); otherwise `spec.model` is loaded."""
    ridge = spec.compute_bound_tokens or default_compute_bound_tokens(device, target.dtype)
    policy = AdaptiveK(spec.num_speculative_tokens, adaptive=spec.adaptive, compute_bound_tokens=ridge)
    # CPUs: measure the step costs at start-up (spec/costs.py), unless a ridge point is given
    policy.profile_on_bind = spec.adaptive and spec.compute_bound_tokens is None and device.type == "cpu"
    if spec.method == "ngram":
        from specserve.spec_decode.ngram import NgramProposer

        policy.decay = 0.95  # estimates per match length pool all requests: a longer memory
        return NgramProposer(policy, prompt_lookup_min=spec.prompt_lookup_min,
                             prompt_lookup_max=spec.prompt_lookup_max,
                             max_num_batched_tokens=max_num_batched_tokens)
    # a draft model's or a head's estimates are per request: each leans on all requests' recent
    # acceptance (worth 16 tried drafts, against at most ~10 of a request's own at decay 0.8)
    policy.shared_prior, policy.prior_weight = True, 16.0
    if spec.method in EAGLE_METHODS:
        return _eagle_proposer(spec, policy, target, device, max_positions, max_num_batched_tokens)
    from specserve.quant.self_draft import is_self_draft
    from specserve.spec_decode.draft_model import DraftModelProposer

    if draft_model is not None:
        module, identity = draft_model, (spec.model or "module", spec.quantization or "")
    elif is_self_draft(spec.model):  # the target's own weights (specserve.quant)
        from specserve.quant.self_draft import build_self_draft, estimated_draft_cost

        module = build_self_draft(target.model, spec.quantization)
        identity = ("self", target.path, spec.quantization or "")
        if spec.draft_cost is None:  # same parameter count, fewer bytes to read per step
            spec = dataclasses.replace(spec, draft_cost=estimated_draft_cost(target.model, module))
    else:
        from specserve.models.loader import load_model

        loaded = load_model(spec.model, dtype=_DTYPE_NAMES[target.dtype], device=device,
                            load_format=spec.load_format, max_positions=max_positions, seed=seed,
                            quantization=spec.quantization)
        check_same_vocab(target, loaded)
        module, identity = loaded.model, (loaded.path, str(loaded.dtype), spec.quantization or "",
                                          spec.load_format)
    if module.cfg.vocab_size != target.arch.vocab_size:
        raise ValueError(f"the draft has {module.cfg.vocab_size} tokens, the target {target.arch.vocab_size}")
    _price_drafter(policy, spec, target, module.cfg.num_params, module.cfg.vocab_size * module.cfg.hidden_size)
    logger.info("draft model %s: %.0fM params, draft step ~%.2f target steps", spec.model,
                module.cfg.num_params / 1e6, policy.draft_cost)
    return DraftModelProposer(module, policy, identity=identity, num_speculative_tokens=spec.num_speculative_tokens,
                              max_num_batched_tokens=max_num_batched_tokens)


def _price_drafter(policy: AdaptiveK, spec: SpecConfig, target: LoadedModel, num_params: int,
                   logits_params: int) -> None:
    """The policy's prices for a drafter of `num_params` parameters per draft step, `logits_params` of
    them its logits: a draft step relative to a target step by the weight bytes read, when memory bound
    (measured instead where `measure_draft_cost` lets it), and a catch-up position, which computes no
    logits (only the newest does), relative to a target token; the config's `draft_cost` for both
    where it gives one."""
    policy.measure_draft_cost = spec.draft_cost is None
    given = spec.draft_cost
    policy.draft_cost = given if given is not None else num_params / target.arch.num_params
    policy.catch_up_share = given if given is not None else (num_params - logits_params) / target.arch.num_params


def _eagle_proposer(spec: SpecConfig, policy: AdaptiveK, target: LoadedModel, device: torch.device,
                    max_positions: int, max_num_batched_tokens: int) -> Proposer:
    """An EAGLE head: `spec.model`, or the one shipped for the default model; random weights with
    load_format dummy (benchmarks: the target's layer shape, a draft vocabulary of its first
    min(32768, vocab) ids; with method eagle3 fusing `default_aux_layers`). A head that fuses some of
    the target's layers has the target's forward return their outputs too."""
    from specserve.spec_decode.eagle import EagleProposer
    from specserve.spec_decode.eagle_head import (EagleHead, default_aux_layers, head_config, load_head,
                                                  shipped_head, target_weights)

    if spec.load_format == "dummy":
        vocab = torch.arange(min(32768, target.arch.vocab_size))
        aux = default_aux_layers(target.arch.num_layers) if spec.method == "eagle3" else ()
        head = EagleHead(head_config(target.arch), max_positions, vocab, target_name=target.path, aux_layers=aux)
        torch.manual_seed(0)
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
        head = head.to(device=device, dtype=target.dtype)
        path = "dummy"
    else:
        path = spec.model or shipped_head(target.path)
        head = load_head(path, dtype=target.dtype, device=device, max_positions=max_positions)
    if spec.draft_vocab == "full":
        head.widen_draft_vocab(target.arch.vocab_size)
    head.attach(*target_weights(target, device, target.dtype))  # whole tensors, also under tensor parallelism
    if head_quantization(spec.quantization, head, device) == "int8":
        head.use_int8_weights()
        if device.type != "cuda":
            logger.warning("the EAGLE head's int8 weights run without their kernel on %s (each weight widened "
                           "every call): slower than the head as trained there", device.type)
    if spec.method == "eagle3" and not head.aux_layers:
        raise ValueError(f"speculative method eagle3 needs a head that fuses several of the target's layers; "
                         f"{path} reads the last hidden state alone: use method eagle")
    fuse_target_layers(target, head.aux_layers, head.fuse_layers)
    # an int8 head is priced as the float one (what it reads past INT8_MAX_ROWS rows); on CUDA its chain's
    # measured seconds price it where they are lower (EagleProposer.capture_graphs)
    _price_drafter(policy, spec, target, head.num_params, head.draft_vocab_size * head.cfg.hidden_size)
    logger.info("EAGLE head %s: %.1fM params%s, draft vocabulary %d, draft step ~%.3f target steps", path,
                head.num_params / 1e6, " (int8 weights)" if head.int8_weights else "", head.draft_vocab_size,
                policy.draft_cost)
    return EagleProposer(head, policy, identity=(str(path), str(target.dtype), "int8" if head.int8_weights else ""),
                         num_speculative_tokens=spec.num_speculative_tokens,
                         max_num_batched_tokens=max_num_batched_tokens)


# a head whose draft step reads at least this many bytes of weights (in its own dtype) runs its GEMMs
# bandwidth bound on a GPU, where int8 rows pay (BENCHMARKS.md, 2026-12-05: 8B shapes, ~200 MB of bf16
# a draft step); a small one's (the default model's, 18 MB) are launch bound and it stays as trained
INT8_HEAD_MIN_BYTES = 64 << 20


def head_quantization(asked: str | None, head: EagleHead, device: torch.device) -> str:
    """An EAGLE head's weights: as asked ("int8", "none"), or by default int8 on CUDA for a head whose
    draft step reads at least INT8_HEAD_MIN_BYTES, else none (as trained)."""
    if asked is not None:
        return asked
    large = head.num_params * head.dtype.itemsize >= INT8_HEAD_MIN_BYTES
    return "int8" if device.type == "cuda" and large else "none"


def fuse_target_layers(target: LoadedModel, aux_layers: tuple[int, ...],
                       features: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor] | None = None) -> None:
    """Have the target's forward also return the outputs of `aux_layers` (an EAGLE head's fused
    layers), or, given the head's `features` (`EagleHead.fuse_layers`), their fused feature, computed
    inside the forward (inside its CUDA graphs: no host work per step); or refuse a target that cannot."""
    if not aux_layers:
        return
    model, num_layers = target.model, target.arch.num_layers
    if max(aux_layers) >= num_layers:
        raise ValueError(f"the EAGLE head fuses target layers {list(aux_layers)}, but the target has {num_layers}")
    if not hasattr(model, "aux_layers"):
        raise ValueError(f"an EAGLE head that fuses target layers needs a Llama-family target, not "
                         f"{target.arch.architecture}")
    model.aux_layers = tuple(aux_layers)
    model.aux_features = features
