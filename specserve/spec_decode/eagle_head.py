"""An EAGLE-style draft head: one decoder layer over the target's last hidden state and the embedding
of the next token, with the target's embedding and a reduced draft vocabulary of the target's LM head.

Entries. The head keeps its own KV (one layer) under the request's block ids. Its entry at position
j reads the token x_j and the target's hidden state h_{j-1} at the position before (zeros at j = 0):

    g_j = norm(layer(fc([norm_e(embed(x_j)), norm_h(h_{j-1})])))      logits_j = lm_head_draft(g_j)

and predicts x_{j+1}. So entry j depends on tokens x_0..x_j only, like the target's KV at j: a block
found in the prefix cache holds valid head entries for its tokens. Chain drafting: after the target
verified up to the context's last token x_{L-1} (entry L-1 computed with the real h_{L-2}), the
first draft d_1 comes from logits_{L-1}; entry L reads (d_1, g_{L-1}) -- the head's own output in
place of the target's hidden state it does not have -- and gives d_2; and so on.

Fused layers (EAGLE-3's feature fusion, `aux_layers`): a head may also read the outputs of some of
the target's earlier decoder layers (the residual stream after them), which the target's forward
returns beside its final hidden states. The head's input feature is then
`f_j = fuse([h_j, norm_1(a1_j), norm_2(a2_j), ...])` in place of h_j (`features`: one linear map back
to the hidden size, computed once per target position and kept per KV slot like h_j was); the head's
own output still stands in for it when chaining. A head without aux layers reads h_j as is.

Training (`train_forward`, specserve/spec_decode/train.py) runs the same entries densely over whole
sequences, `depth` times: at depth d the hidden input is the head's depth d-1 output one position
back, and the attention mask is exactly what chain step d sees at inference (the real entries up to
where the chain started, then the chain's own entries): EAGLE-3's training-time test.

Checkpoint (a directory): `config.json` ({"architectures": ["EagleHead"], the layer's shape, the
target's hidden size / vocabulary and name}) and `model.safetensors` (the head's weights and
`draft_vocab`: the target token id of every draft-vocabulary row). The head owns no embedding and no
LM head: both are the target's (`attach`), the LM head cut to the draft vocabulary's rows.

`target_weights` gives `attach` the target's full embedding and LM head: the module's own tensors,
or, when the target is split over tensor-parallel ranks, the checkpoint's (the head runs on rank 0).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specserve.config import EAGLE_HEAD_ARCHITECTURE, is_head_dir
from specserve.models.layers.attention import AttentionBackend, AttentionMetadata
from specserve.models.layers.basic import RMSNorm, RotaryEmbedding, fused_ops
from specserve.models.llama import DecoderLayer
from specserve.models.registry import ArchConfig

ARCHITECTURE = EAGLE_HEAD_ARCHITECTURE
WEIGHTS = "model.safetensors"
FUSE_PARAMS = ("fuse.", "aux_norms.")  # the weights of a head's fused layers (state-dict name prefixes)


class EagleHead(nn.Module):
    def __init__(self, cfg: ArchConfig, max_positions: int, draft_vocab: torch.Tensor,
                 target_name: str = "", aux_layers: tuple[int, ...] = ()) -> None:
        """cfg: the head's layer shape (num_layers 1; hidden size = the target's); draft_vocab: [Vd]
        target token ids, one per row of the head's LM head; aux_layers: the target's decoder layers
        (0-based, ascending) whose outputs the head fuses with the final hidden state (none: it
        reads the final hidden state alone)."""
        super().__init__()
        if cfg.num_layers != 1:
            raise ValueError(f"an EAGLE head has one decoder layer, this config has {cfg.num_layers}")
        self.cfg = cfg
        self.target_name = target_name
        h = cfg.hidden_size
        self.aux_layers = tuple(int(i) for i in aux_layers)
        if list(self.aux_layers) != sorted(set(self.aux_layers)) or any(i < 0 for i in self.aux_layers):
            raise ValueError(f"an EAGLE head's aux layers must be distinct, ascending layer indices, got {aux_layers}")
        if self.aux_layers:
            self.fuse = nn.Linear((1 + len(self.aux_layers)) * h, h, bias=False)
            self.aux_norms = nn.ModuleList(RMSNorm(h, cfg.rms_norm_eps) for _ in self.aux_layers)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, RotaryEmbedding(cfg.head_dim, max_positions,
                                                                       cfg.rope_theta, cfg.rope_scaling))])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.register_buffer("draft_vocab", draft_vocab.to(torch.long), persistent=False)
        # the target's, set by `attach` (not parameters of the head: never saved, never trained)
        self.__dict__["_embed"] = None  # the target's embedding weight [V, h], set by attach
        self._lm_head: torch.Tensor | None = None  # [Vd, h]: the target's LM head rows of draft_vocab
        # those rows as a layer: packed for oneDNN (CPU inference: use_packed_linears) or int8 (use_int8_weights)
        self._lm_head_layer: nn.Module | None = None
        self.int8_weights = False  # use_int8_weights
        self.backend: AttentionBackend | None = None  # set by the model executor
        self.graph_inputs = {"hidden_states": h}  # extra inputs a captured graph must hold (engine/cuda_graphs.py)
        # kept per KV slot by the head's executor (engine/executor.py): the target's hidden states,
        # so the head can catch up on positions of earlier steps (spec_decode/eagle.py)
        self.slot_states = {"hidden_states": h}

    @property
    def dtype(self) -> torch.dtype:
        """The head's weights' dtype (read from a norm: its linear layers may be packed for oneDNN)."""
        return self.norm.weight.dtype

    @property
    def draft_vocab_size(self) -> int:
        return self.draft_vocab.numel()

    @property
    def num_params(self) -> int:
        """Weights one draft step reads: the layer, fc, the norms and the draft LM head rows (not
        `fuse`: it runs once per target position, in the target's forward when serving)."""
        own = sum(p.numel() for name, p in self.named_parameters() if not name.startswith(FUSE_PARAMS))
        return own + self.draft_vocab_size * self.cfg.hidden_size

    def widen_draft_vocab(self, vocab_size: int) -> None:
        """Draft over every one of the target's `vocab_size` tokens: the trained draft vocabulary's ids,
        then the rest. The LM head rows are the target's own (`attach`), so the added rows need no
        training; the head's output, trained to read like the target's hidden state, ranks them too
        (the default model's head: mean acceptance length +3-4% on held-out prompts, BENCHMARKS.md), for
        a draft step that reads all the rows. Before `attach`."""
        if self._lm_head is not None or self._lm_head_layer is not None:
            raise RuntimeError("widen_draft_vocab must come before attach")
        own = self.draft_vocab.cpu()
        if int(own.max()) >= vocab_size:
            raise ValueError(f"the head's draft vocabulary has ids past the target's {vocab_size} tokens")
        rest = torch.ones(vocab_size, dtype=torch.bool)
        rest[own] = False
        self.draft_vocab = torch.cat([own, rest.nonzero().squeeze(1)]).to(self.draft_vocab.device)

    # -- the target's parts ----------------------------------------------------------------------
    def attach(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Share the target's embedding [V, h] and the draft vocabulary's rows of its LM head [V, h]
        (full, unsharded tensors: under tensor parallelism the head runs on rank 0 alone)."""
        if embed_weight.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"the EAGLE head was trained for hidden size {self.cfg.hidden_size}, the target "
                             f"has {embed_weight.shape[1]}")
        vocab = embed_weight.shape[0]
        if self.cfg.vocab_size != vocab:
            raise ValueError(f"the EAGLE head was trained for a target vocabulary of {self.cfg.vocab_size} "
                             f"tokens, the target has {vocab}")
        if lm_head_weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError("the EAGLE head needs the target's LM head unquantized (leave quantize_embeddings off)")
        self.__dict__["_embed"] = embed_weight  # references, not parameters: never saved, moved or trained
        self.draft_vocab = self.draft_vocab.to(lm_head_weight.device)
        with torch.no_grad():
            self._lm_head = lm_head_weight[self.draft_vocab].detach().clone()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self._embed)

    def features(self, target_out: torch.Tensor) -> torch.Tensor:
        """The target's forward output [T, (1 + len(aux_layers)) * h] -> the head's input feature
        [T, h] (with no aux layers, the final hidden state itself)."""
        if not self.aux_layers:
            return target_out
        final, *aux = target_out.split(self.cfg.hidden_size, dim=-1)
        return self.fuse_layers(final, aux)

    def fuse_layers(self, final: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """The feature from the target's final hidden states [T, h] and its aux layers' outputs (each
        [T, h]): what the target's forward computes itself when serving (`fuse_target_layers`)."""
        return self.fuse(torch.cat([final, *(norm(a) for norm, a in zip(self.aux_norms, aux))], dim=-1))

    def init_fuse_identity(self) -> None:
        """fuse passes the final hidden state through and ignores the aux layers: the head then
        computes what a head without them does (a start for training)."""
        h = self.cfg.hidden_size
        with torch.no_grad():
            self.fuse.weight.zero_()
            self.fuse.weight[:, :h].copy_(torch.eye(h))

    # -- inference -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; hidden_states: [T, h], the target's hidden state one position
        back (or the head's own output, chain drafting; None = zeros) -> the head's outputs g [T, h]."""
        if input_ids.is_cuda and fused_ops() is not None:
            from specserve.kernels.head_input import checked_head_input  # (CUDA only)

            # one kernel for the gather, both norms (one eps: both are cfg.rms_norm_eps) and the cat
            x = self.fc(checked_head_input(input_ids, self._embed, hidden_states, self.embed_norm.weight,
                                           self.hidden_norm.weight, self.embed_norm.eps))
        else:
            e = self.embed(input_ids)
            if hidden_states is None:
                hidden_states = torch.zeros_like(e)
            x = self.fc(torch.cat([self.embed_norm(e), self.hidden_norm(hidden_states)], dim=-1))
        x, residual = self.layers[0](positions, x, None, kv_caches[0], meta, self.backend)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """g [N, h] -> fp32 logits over the draft vocabulary [N, Vd] (row i = target id draft_vocab[i])."""
        return self.draft_logits(hidden).float()

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """g [N, h] -> the draft logits [N, Vd] in the layer's own dtype: where only their argmax is read
        (greedy drafts) the fp32 cast changes no value, so no order, and its kernel is left out."""
        if self._lm_head_layer is not None:
            return self._lm_head_layer(hidden)
        return nn.functional.linear(hidden, self._lm_head)

    def pick_greedy(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """CUDA: each row's greedy draft (a target id) written into out [N] int64 (a column of the
        drafts), from g [N, h]: with float LM head rows and a few rows in one product-and-pick (no
        logits in memory, kernels/greedy_pick.py), else the layer's logits and one pick."""
        from specserve.kernels.greedy_pick import MAX_FUSED_ROWS, greedy_pick, linear_greedy_pick  # (CUDA only)

        if self._lm_head_layer is None and self._lm_head is not None and self._lm_head.dtype == hidden.dtype \
                and hidden.shape[0] <= MAX_FUSED_ROWS:
            return linear_greedy_pick(hidden, self._lm_head, out, self.draft_vocab)
        return greedy_pick(self.draft_logits(hidden), out, self.draft_vocab)

    def use_packed_linears(self, pack: Callable[[torch.Tensor], nn.Module | None]) -> int:
        """The draft LM head's rows run packed (models/layers/cpu_linear.py); the tensor stays for training."""
        if self._lm_head is None:  # an int8 head's rows are in its own layer (use_int8_weights)
            return 0
        self._lm_head_layer = pack(self._lm_head)
        return int(self._lm_head_layer is not None)

    def use_int8_weights(self) -> int:
        """Weight-only int8 (quant/int8_linear.py) for the linear layers a draft step runs (fc, the
        decoder layer's) and the draft LM head's rows: a draft step over up to INT8_MAX_ROWS rows reads
        about half the bytes; more rows read the float weights, kept beside. Not `fuse`: the target's
        forward runs it over every row of every step. After `attach`; inference only. Returns how many
        layers changed."""
        from specserve.quant.int8_linear import Int8Linear, quantize_linears

        if self._lm_head is None:
            raise RuntimeError("attach the EAGLE head to its target before quantizing it")
        swapped = quantize_linears(self, skip=("fuse",))
        self._lm_head_layer = Int8Linear(self._lm_head)
        self._lm_head = None
        self.int8_weights = True
        return swapped + 1

    # -- training --------------------------------------------------------------------------------
    def train_forward(self, input_ids: torch.Tensor, target_hidden: torch.Tensor, depth: int,
                      seq_lens: list[int] | None = None) -> list[torch.Tensor]:
        """Sequences packed end to end, densely, `depth` times (the training-time test). input_ids:
        [N] tokens; target_hidden: [N, h] (or [N, (1 + len(aux_layers)) * h]), the target's forward
        output at them; seq_lens: the
        sequences' lengths (None: one sequence of N). Returns per depth d the head's outputs [N, h];
        row j of a sequence at depth d predicts its x_{j+1} as chain step d does when it starts from
        the real entries up to j - d. One pass serves the whole batch: the operator count of a
        training step does not grow with the number of sequences in it."""
        layer = self.layers[0]
        attn = layer.self_attn
        n = input_ids.shape[0]
        packing = _Packing(seq_lens or [n], input_ids.device)
        e = self.embed_norm(self.embed(input_ids))
        hidden = packing.shift(self.features(target_hidden))
        keys, values, outputs = [], [], []
        for _ in range(depth):
            x = self.fc(torch.cat([e, self.hidden_norm(hidden)], dim=-1))
            residual = x
            x = layer.input_layernorm(x)
            q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q = q.view(n, attn.num_heads, attn.head_dim)
            k = k.view(n, attn.num_kv_heads, attn.head_dim)
            v = v.view(n, attn.num_kv_heads, attn.head_dim)
            if attn.q_norm is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = attn.rotary(packing.positions, q, k)
            keys.append(packing.pad(k))
            values.append(packing.pad(v))
            out = packing.unpad(_chain_attention(packing.pad(q), keys, values, attn.scale))
            x = attn.o_proj(out.reshape(n, attn.q_size))
            x, residual = layer.post_attention_layernorm(x, residual)
            g, _ = self.norm(layer.mlp(x), residual)
            outputs.append(g)
            hidden = packing.shift(g)
        return outputs


class _Packing:
    """Sequences packed end to end ([N, ...] rows) and the same rows padded per sequence
    ([B, L, ...], L the longest), for attention within each sequence alone."""

    def __init__(self, seq_lens: list[int], device: torch.device) -> None:
        lens = np.asarray(seq_lens, dtype=np.int64)
        local = packed_positions(seq_lens)
        self.num_seqs, self.max_len = len(lens), -(-int(lens.max()) // _PAD_TO) * _PAD_TO
        self.positions = upload(local, device)
        self.padded_rows = upload(np.repeat(np.arange(len(lens)) * self.max_len, lens) + local, device)
        self.not_first = upload((local > 0).astype(np.float32)[:, None], device)

    def shift(self, rows: torch.Tensor) -> torch.Tensor:
        """Row j of each sequence gets its row j - 1 (zeros at its first row): entry j's hidden input."""
        return torch.cat([torch.zeros_like(rows[:1]), rows[:-1]]) * self.not_first.to(rows.dtype)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, L, ...] (zeros past each sequence's end)."""
        out = rows.new_zeros((self.num_seqs * self.max_len, *rows.shape[1:]))
        return out.index_copy(0, self.padded_rows, rows).view(self.num_seqs, self.max_len, *rows.shape[1:])

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded.reshape(self.num_seqs * self.max_len, *padded.shape[2:]).index_select(0, self.padded_rows)


def packed_positions(seq_lens: list[int]) -> np.ndarray:
    """Each row's index in its own sequence, for sequences packed end to end."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    return np.arange(int(lens.sum())) - np.repeat(starts, lens)


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without waiting for the device's queue (pinned on CUDA)."""
    t = torch.from_numpy(array)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def target_weights(target, device: torch.device, dtype: torch.dtype, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, LM head) weights [V, h] of a loaded target, whole: its module's when they hold
    the whole vocabulary, else (a tensor-parallel rank's shard) read from its checkpoint, or drawn
    at random for dummy weights."""
    model, vocab = target.model, target.arch.vocab_size
    embed = model.embed_tokens.weight
    if embed.shape[0] == vocab:
        return embed, (model.lm_head.weight if model.lm_head is not None else embed)
    names = {"model.embed_tokens.weight": None, "lm_head.weight": None}
    path = Path(target.path)
    if (path / "config.json").exists():
        from safetensors import safe_open

        from specserve.models.loader import _safetensors_files

        for f in _safetensors_files(path):
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in names.keys() & set(sf.keys()):
                    names[name] = sf.get_tensor(name).to(device=device, dtype=dtype)
    else:  # dummy weights: random, as the loader draws them
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name in names:
            names[name] = (torch.randn(vocab, target.arch.hidden_size, generator=gen) * 0.02).to(device, dtype)
    embed_w = names["model.embed_tokens.weight"]
    if embed_w is None:
        raise ValueError(f"{target.path}: no model.embed_tokens.weight in the checkpoint for the EAGLE head")
    head_w = embed_w if target.arch.tie_word_embeddings or names["lm_head.weight"] is None else names["lm_head.weight"]
    return embed_w, head_w


def chain_mask(n: int, depth: int, device=None) -> torch.Tensor:
    """[n, (depth + 1) * n] bool: what query row j at depth `depth` may attend among the keys of
    depths 0..depth (concatenated): depth-0 keys i <= j - depth (the real entries the chain started
    after), then at depth e (1..depth) only the key at j - depth + e (the chain's own entry there).
    Every row may attend at least its own key at depth `depth`."""
    j = torch.arange(n, device=device)[:, None]
    i = torch.arange(n, device=device)[None, :]
    blocks = [i <= j - depth] + [i == j - depth + e for e in range(1, depth + 1)]
    return torch.cat(blocks, dim=1)


# not cuDNN's: it builds a graph per new shape (about 0.5 s on an H200), and training shapes change
# every step
_CHAIN_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
_PAD_TO = 64  # the padded length is a multiple of this: few distinct attention shapes


def _chain_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """q [B, L, H, D] at depth len(keys) - 1 over the keys / values [B, L, KVH, D] of depths 0..that,
    each sequence (row of B) over its own. Padding past a sequence's end is never attended by its
    rows: they see keys at or before themselves only."""
    num_heads = q.shape[2]
    k = torch.cat(keys, dim=1)  # [B, (d + 1) L, KVH, D]
    v = torch.cat(values, dim=1)
    group = num_heads // k.shape[2]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    mask = chain_mask(q.shape[1], len(keys) - 1, q.device)
    with sdpa_kernel(_CHAIN_BACKENDS):
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


# -- checkpoints ---------------------------------------------------------------------------------
def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers a fused head reads besides the final hidden state: an early one (the third)
    and the middle one, as EAGLE-3 picks low and middle features (the final hidden state stands for
    the high ones); never the last layer, whose output the final hidden state is."""
    return tuple(sorted(i for i in {min(2, num_layers - 2), num_layers // 2} if 0 <= i < num_layers - 1))


def head_config(target: ArchConfig, **overrides: Any) -> ArchConfig:
    """The head's layer shape: the target's decoder layer, one of it."""
    return dataclasses.replace(target, num_layers=1, raw={}, **overrides)


def save_head(head: EagleHead, out_dir: str | Path, extra: dict | None = None) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = head.cfg
    config = {
        "architectures": [ARCHITECTURE], "model_type": "eagle_head", "target": head.target_name,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings, "attention_bias": cfg.qkv_bias,
        "qk_norm": cfg.qk_norm, "target_vocab_size": cfg.vocab_size,
        "draft_vocab_size": head.draft_vocab_size, "aux_layers": list(head.aux_layers), **(extra or {}),
    }
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in head.state_dict().items()}
    tensors["draft_vocab"] = head.draft_vocab.to("cpu", torch.int64).contiguous()
    save_file(tensors, str(out / WEIGHTS))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


HEADS_DIR = Path(__file__).parent / "heads"  # heads shipped with the package, one directory per target


def shipped_head(target_path: str | Path) -> Path:
    """The head shipped for a target (the default model), or a clear error."""
    from specserve.models.default_paths import MODEL_NAME, default_model_dir

    target = Path(target_path)
    if target.resolve() == default_model_dir().resolve() or target.name == MODEL_NAME:
        head = HEADS_DIR / MODEL_NAME
        if is_head_dir(head):
            return head
    raise ValueError(f"no EAGLE head ships for {target_path}: give one in speculative_config "
                     "{\"method\": \"eagle\", \"model\": HEAD_DIR} (make it with `specserve train-draft`)")


def load_head(path: str | Path, *, dtype: torch.dtype, device: torch.device, max_positions: int) -> EagleHead:
    """A head saved by `save_head` (not yet attached to a target). A directory that is not one is
    refused with what it is instead."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"EAGLE head not found: {path} (a directory made by `specserve train-draft`)")
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from None
    if ARCHITECTURE not in raw.get("architectures", []):
        raise ValueError(f"{path} is not an EAGLE head (architectures {raw.get('architectures')}); "
                         "for a whole draft model use method draft_model")
    try:
        cfg = ArchConfig(
            architecture=ARCHITECTURE, vocab_size=int(raw["target_vocab_size"]), hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]), num_layers=1,
            num_heads=int(raw["num_attention_heads"]), num_kv_heads=int(raw["num_key_value_heads"]),
            head_dim=int(raw["head_dim"]), rms_norm_eps=float(raw["rms_norm_eps"]),
            rope_theta=float(raw["rope_theta"]), rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=int(raw["max_position_embeddings"]), tie_word_embeddings=True,
            qkv_bias=bool(raw.get("attention_bias", False)), torch_dtype=None, qk_norm=bool(raw.get("qk_norm")))
    except KeyError as e:
        raise ValueError(f"{config_file}: missing field {e.args[0]!r}") from None
    weights = path / WEIGHTS
    if not weights.is_file():
        raise ValueError(f"EAGLE head {path} has no {WEIGHTS}")
    tensors = load_file(str(weights))
    draft_vocab = tensors.pop("draft_vocab", None)
    if draft_vocab is None or draft_vocab.dim() != 1:
        raise ValueError(f"EAGLE head {path}: {WEIGHTS} has no draft_vocab id map")
    if int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= cfg.vocab_size:
        raise ValueError(f"EAGLE head {path}: draft_vocab has ids outside the target vocabulary of {cfg.vocab_size}")
    aux = raw.get("aux_layers") or []
    if not isinstance(aux, list) or not all(isinstance(i, int) for i in aux):
        raise ValueError(f"{config_file}: aux_layers must be a list of layer indices, got {aux!r}")
    try:
        head = EagleHead(cfg, max_positions, draft_vocab, target_name=raw.get("target", ""), aux_layers=tuple(aux))
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
    try:
        head.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise ValueError(f"EAGLE head {path}: weights do not match its config.json: {e}") from None
    return head.to(device=device, dtype=dtype)
