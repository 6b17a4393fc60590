"""CUDA graphs for decode and verification steps, and for short prefill steps, replayed over persistent
buffers.

Two kinds of graph, each keyed by (padded number of requests, padded number of tokens, max query length):
- A step whose requests each compute at most `Q` tokens (Q = 1: decode; Q = 1 + k: speculative
  verification) replays the graph of (padded batch size B in `CAPTURE_SIZES`, B * Q, Q). Padding
  requests compute one token each that writes no KV (slot -1) and attends one slot.
- A step with a longer query (a prompt or its chunk, alone or beside decoding requests: an admission)
  of up to the largest of `PREFILL_LENS` tokens in all replays the graph of (the largest batch size,
  the next such token count T, T). Padding requests compute no tokens; padding tokens (past the real
  ones) are computed, write no KV and are never read back. An eager forward launches each layer's
  kernels from Python: on an H200, ~11 ms of host time for the default model's 30 layers against
  well under 1 ms on the device, most of a prompt's time to first token at one request, and the
  admission steps that speculation's staggered request ends multiply.
A verification graph (Q > 1) may also have a verdict variant (`verdicts`): the same forward, then the
target's LM head over every row, its argmax, and each request's accepted drafts (greedy), replayed for a
step whose requests all verify Q - 1 drafts on the device. Those launches (~0.2 ms of host time a step on
an H100's host, eager) then cost none: at one request the host sets a drafting step's pace.
At run time the real tokens fill the front of the buffers (ragged: `query_start_loc` is copied in).
The attention kernels take their grid from python ints only (`max_seq_len` only picks how far the
KV range is split), so a graph replays correctly for any contexts and for queries its `max_query_len`
bounds. Other steps (more tokens, more requests) run eagerly.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from specserve.engine.step_inputs import HostStaging, _layout
from specserve.models.layers.attention import PAD_SLOT_ID, AttentionMetadata

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# token counts of prefill graphs: steps of 1.5x (1.33x from 512), so padding costs at most half the tokens
PREFILL_LENS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
# the most tokens of a prefill graph, by the model it replays (`prefill_graph_tokens`). The target: 512.
# Past that a large model's forward is bound by its device work, and padding costs about what launching
# eagerly saves (H100, 8B shapes, 64 requests decoding: an admission of 4 prompts, 576 tokens, took
# 17.4 ms eager against 20.0 ms from a graph of 768, 6 prompts 26.1 ms against 25.2 ms from one of 1,024;
# bench/admission_steps.py; a small target's eager forward is all host launches, where longer graphs would
# likely pay: not measured). A drafter (an EAGLE head, a draft model) is cheap on the device per token
# and dear on the host per launch: past 512 rows an EAGLE head's eager catch-up over an admission's
# prompts kept an admission of 4 prompts beside 64 drafting requests at 34.3 ms, against 19.6-21.7 ms
# replayed (same card and shapes, the same bench)
TARGET_PREFILL_TOKENS, DRAFTER_PREFILL_TOKENS = 512, 2048
# the most bytes of fp32 logits a verdict graph computes (its rows x the vocabulary), scratch in the graphs'
# memory pool. The default model's vocabulary fits every batch (256 requests verifying 4 drafts); an 8B
# model's (128k) 96 requests verifying 4, 128 verifying 3: 64 requests on 8B shapes were host-bound (a
# drafting step 10.1 ms against 7.06 ms plain, H100, 2026-12-05), where the host work a verdict saves counts
VERDICT_LOGITS_BYTES = 256 << 20


def prefill_graph_tokens(chunk_tokens: int, drafter: bool) -> int:
    """The most tokens of a prefill graph for the target (`drafter` False) or a drafter, whose steps
    compute at most `chunk_tokens` tokens (the scheduler's budget, bounded by the context length)."""
    return min(chunk_tokens, DRAFTER_PREFILL_TOKENS if drafter else TARGET_PREFILL_TOKENS)


def query_lens_up_to(most: int) -> tuple[int, ...]:
    """The query lengths to capture decode and verification graphs for: every one up to `most` tokens a
    request, so that a step verifying fewer drafts than the cap replays a graph of its own length."""
    return tuple(range(1, most + 1))


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    """Seconds one replay of a captured graph takes (its device time: the best of `reps`, each waited for)."""
    best = float("inf")
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


class StepGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], device: torch.device, block_size: int,
                 max_model_len: int, max_num_seqs: int, query_lens: tuple[int, ...] = (1,),
                 max_prefill_tokens: int = 0, plain_decode: bool = False, verdicts: bool = False) -> None:
        """query_lens: Q of the decode graphs, captured for every batch size; max_prefill_tokens: the
        most tokens (of `PREFILL_LENS`, up to it) of a prefill graph (0: none); plain_decode: for a
        target that computes an EAGLE head's fused feature (`aux_features`), also capture each
        one-token decode graph without it (`run(..., aux=False)`: the final hidden states alone);
        verdicts: also capture the verdict variant of each verification graph (Q > 1) whose logits
        take at most `VERDICT_LOGITS_BYTES` (`run_verdict`)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = [s for s in CAPTURE_SIZES if s < max_num_seqs] + [max_num_seqs]
        self.sizes = sorted(set(s for s in self.sizes if s <= max(CAPTURE_SIZES)))
        self.query_lens = tuple(sorted(set(query_lens)))
        max_batch = self.sizes[-1]
        self.prefill_lens = tuple(t for t in PREFILL_LENS if self.query_lens[-1] < t <= max_prefill_tokens)
        # (padded requests, padded tokens, max query length)
        self.keys = [(b, b * q, q) for q in self.query_lens for b in self.sizes] + \
                    [(max_batch, t, t) for t in self.prefill_lens]
        max_tokens = max(t for _, t, _ in self.keys)
        max_blocks = -(-max_model_len // block_size)
        # the graphs' integer inputs: views of one region (`stage` writes a step into it with one copy)
        self.layout = _RegionLayout(-(-max_tokens // 2) * 2, max_batch, max_blocks)  # rows 16-byte aligned
        self.region = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=device)
        lay = self.layout
        self.input_ids, self.positions, self.slot_mapping = self.region[:lay.extras].view(torch.long).view(3, -1)
        self.extras = self.region[lay.extras:lay.qsl].view(torch.long)
        self.query_start_loc = self.region[lay.qsl:lay.seq_lens].view(torch.int32)[:max_batch + 1]
        self.seq_lens = self.region[lay.seq_lens:lay.tables].view(torch.int32)[:max_batch]
        self.block_tables = self.region[lay.tables:].view(torch.int32).view(max_batch, max_blocks)
        self._arange = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.slot_mapping.fill_(PAD_SLOT_ID)
        self.seq_lens.fill_(1)
        self.query_start_loc.copy_(self._arange)
        # a model's further per-token inputs (an EAGLE head's hidden states): name -> width
        dtype = next(model.parameters()).dtype
        self.inputs = {name: torch.zeros(max_tokens, width, dtype=dtype, device=device)
                       for name, width in getattr(model, "graph_inputs", {}).items()}
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, int], torch.Tensor] = {}
        # the plain variants (no aux outputs) of the one-token decode graphs, same buffers and pool
        fuses = getattr(model, "aux_features", None) is not None  # a target fusing a head's layers
        self.plain_keys = [k for k in self.keys if k[2] == 1] if plain_decode and fuses else []
        self.plain_graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.plain_outputs: dict[tuple[int, int, int], torch.Tensor] = {}
        # the verdict variants of verification graphs (hidden states and verdict), same buffers and pool
        self.verdict_keys = [k for k in self.keys if 1 < k[2] and k[2] not in self.prefill_lens
                             and k[1] * model.cfg.vocab_size * 4 <= VERDICT_LOGITS_BYTES] if verdicts else []
        self.verdict_graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.verdict_outputs: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _meta(self, key: tuple[int, int, int]) -> AttentionMetadata:
        batch, tokens, q = key
        # max_seq_len picks the KV splits of the attention launch that takes short queries, whose
        # partial sums take tokens x heads x splits x head_dim floats (8B shapes at a 128k context, one
        # request: 64 splits, 0.5 GB at 512 tokens). A prefill graph splits at most its token count:
        # a short query beside a long context there (a decode in an admission step) walks more of the
        # context per program
        return AttentionMetadata(
            num_reqs=batch, num_tokens=tokens, max_query_len=q,
            max_seq_len=tokens if q in self.prefill_lens else self.max_model_len,
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch], slot_mapping=self.slot_mapping[:tokens],
            query_lens_cpu=[1] * batch, seq_lens_cpu=[1] * batch, block_size=self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        variants = [(key, "aux") for key in self.keys] + [(key, "plain") for key in self.plain_keys] + \
                   [(key, "verdict") for key in self.verdict_keys]
        captured = {"aux": (self.graphs, self.outputs), "plain": (self.plain_graphs, self.plain_outputs),
                    "verdict": (self.verdict_graphs, self.verdict_outputs)}
        for key, variant in sorted(variants, key=lambda v: -v[0][1]):  # largest first: the rest reuse its pool
            batch, tokens, q = key
            # a valid batch for the warm-up forward: a decode graph's requests one token each, a
            # prefill graph's first request all of them
            self.seq_lens[:batch].fill_(1)
            if q in self.prefill_lens:
                self.query_start_loc[1:batch + 1].fill_(tokens)
                self.seq_lens[0] = tokens
            else:
                self.query_start_loc[:batch + 1].copy_(self._arange[:batch + 1])
            meta = self._meta(key)
            args = (self.input_ids[:tokens], self.positions[:tokens], self.kv_caches, meta)
            inputs = {name: buf[:tokens] for name, buf in self.inputs.items()}
            if variant == "plain":
                inputs["aux"] = False
            forward = self._verdict_forward if variant == "verdict" else self.model
            forward(*args, **inputs)  # warm-up: compile kernels, settle allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = forward(*args, **inputs)
            pool = graph.pool()
            graphs, outputs = captured[variant]
            graphs[key], outputs[key] = graph, output
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (batch %d..%d, query lengths %s; prefills of up to %d tokens%s%s) "
                    "in %.1fs", len(variants), self.sizes[0], self.sizes[-1], self.query_lens,
                    self.prefill_lens[-1] if self.prefill_lens else 0,
                    "; decode also without aux layers" if self.plain_graphs else "",
                    f"; {len(self.verdict_graphs)} verifications with their verdict" if self.verdict_graphs else "",
                    time.perf_counter() - t0)

    def _verdict_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                         meta: AttentionMetadata, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A verdict graph's work: the forward, then the argmax of every row's logits and each request's
        accepted drafts, in one tensor (`Verdict.flat`). Its requests' rows are consecutive, Q each
        (a padding request's one row and the padding tokens after it make the rows past the real
        requests' garbage, never read)."""
        from specserve.spec_decode.rejection import accepted_in_rows

        batch, tokens, q = meta.num_reqs, meta.num_tokens, meta.max_query_len
        hidden = self.model(input_ids, positions, kv_caches, meta, **inputs)
        flat = torch.empty(tokens + batch, dtype=torch.long, device=hidden.device)
        argmax = torch.argmax(self.model.compute_logits(hidden), dim=-1, out=flat[:tokens])
        accepted_in_rows(argmax, input_ids, batch, q, out=flat[tokens:])
        return hidden, flat

    def can_run(self, meta: AttentionMetadata) -> bool:
        return self.holds(meta.num_reqs, meta.max_query_len, meta.num_tokens)

    def holds(self, num_reqs: int, max_query_len: int, num_tokens: int) -> bool:
        """Is a graph captured for a step of `num_reqs` requests computing `num_tokens` tokens, at
        most `max_query_len` each?"""
        return self.key(num_reqs, max_query_len, num_tokens) is not None

    def key(self, num_reqs: int, max_query_len: int, num_tokens: int) -> tuple[int, int, int] | None:
        """The smallest captured graph for such a step (None: none)."""
        if num_reqs > self.sizes[-1]:
            return None
        if max_query_len <= self.query_lens[-1]:  # decode, verification
            batch = next(s for s in self.sizes if s >= num_reqs)
            q = next(q for q in self.query_lens if q >= max_query_len)
            return batch, batch * q, q
        if not self.prefill_lens or num_tokens > self.prefill_lens[-1]:
            return None
        t = next(t for t in self.prefill_lens if t >= num_tokens)
        return self.sizes[-1], t, t

    def stage(self, key: tuple[int, int, int], host: HostStaging, positions: np.ndarray, slots: np.ndarray,
              cu: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray, extras: list[np.ndarray],
              input_ids: np.ndarray | None = None) -> tuple[torch.Tensor, ...] | None:
        """Write a step that graph `key` runs straight into the graphs' buffers, its padding included,
        through one pinned host buffer and one copy (for `batch_metadata`; `run` then copies in only
        the inputs that are not there yet): a copy per buffer costs the host a launch each, ~10 us on
        an H200's host, on the path of every step. Returns views of the buffers: (input ids or None,
        positions, slots, query_start_loc, seq_lens, block tables, *extras), valid until the next step
        is staged (the device reads them in order); None where the step does not fit (more extras
        than the region has room for: the caller uploads as usual). `input_ids`: the step's token ids
        where the host has them all (else zeros go in, and `run` copies the device's)."""
        batch, _, q = key
        num_reqs, num_tokens = len(seq_lens), len(positions)
        width = tables.shape[1]
        lay = self.layout
        offsets, room = _layout([len(a) for a in extras], 8)
        if room > lay.extras_len or width > lay.max_blocks:
            return None
        w = lay.max_blocks
        end = lay.tables + 4 * ((batch - 1) * w + (width if batch == num_reqs else 1))
        buffer, slot = host.host_buffer(end)
        t = lay.max_tokens
        ints = buffer[:lay.qsl].view(np.int64)
        # past the step's tokens, whole buffers: token 0 at position 0, writing no KV (the padding of
        # this graph, and what a step `run` fills without staging finds there)
        ints[:2 * t] = 0
        if input_ids is not None:
            ints[:num_tokens] = input_ids
        ints[t:t + num_tokens] = positions
        ints[2 * t:2 * t + num_tokens] = slots
        ints[2 * t + num_tokens:3 * t] = PAD_SLOT_ID
        for a, o in zip(extras, offsets):
            ints[3 * t + o:3 * t + o + len(a)] = a
        qsl = buffer[lay.qsl:lay.seq_lens].view(np.int32)
        qsl[:num_reqs + 1] = cu
        if q in self.prefill_lens:  # padding requests: no tokens
            qsl[num_reqs + 1:batch + 1] = num_tokens
        else:  # padding requests: one token each, past the real ones
            qsl[num_reqs + 1:batch + 1] = np.arange(num_tokens + 1, num_tokens + batch - num_reqs + 1)
        lens = buffer[lay.seq_lens:lay.tables].view(np.int32)
        lens[:num_reqs] = seq_lens
        lens[num_reqs:batch] = 1
        # block tables: the real rows' first `width` columns (the rest is never read), and a padding
        # request's first block (it reads one slot)
        np.ndarray((num_reqs, width), np.int32, buffer, lay.tables, (4 * w, 4))[:] = tables
        if batch > num_reqs:
            np.ndarray((batch - num_reqs,), np.int32, buffer, lay.tables + 4 * num_reqs * w, (4 * w,))[:] = 0
        host.upload(self.region[:end], slot, end)
        views = [self.input_ids[:num_tokens] if input_ids is not None else None, self.positions[:num_tokens],
                 self.slot_mapping[:num_tokens], self.query_start_loc[:num_reqs + 1], self.seq_lens[:num_reqs],
                 self.block_tables[:num_reqs, :width]]
        return tuple(views + [self.extras[o:o + len(a)] for a, o in zip(extras, offsets)])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            key: tuple[int, int, int], aux: bool = True, **inputs: torch.Tensor) -> torch.Tensor:
        """Replay the graph `key` (the step's `key(...)`; aux=False: its plain variant where one was
        captured); returns hidden [num_tokens, H]. A step that `stage` wrote into the buffers copies
        in only its inputs that are not there yet."""
        self._stage_inputs(input_ids, positions, meta, key, inputs)
        plain = not aux and key in self.plain_graphs
        (self.plain_graphs if plain else self.graphs)[key].replay()
        return (self.plain_outputs if plain else self.outputs)[key][:meta.num_tokens]

    def has_verdict(self, meta: AttentionMetadata, key: tuple[int, int, int]) -> bool:
        """Does a verdict graph hold the step (`key` its `key(...)`): a verification graph with its
        verdict whose query length is the step's, every request computing that many tokens?"""
        return key in self.verdict_graphs and key[2] == meta.max_query_len and \
            meta.num_tokens == meta.num_reqs * key[2]

    def run_verdict(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    key: tuple[int, int, int], **inputs: torch.Tensor) -> tuple[torch.Tensor, Verdict]:
        """`run` for a step that `has_verdict`, replaying the verdict variant: hidden [num_tokens, H]
        and the step's `Verdict` (valid until the graph's next replay, which the device runs in order)."""
        self._stage_inputs(input_ids, positions, meta, key, inputs)
        self.verdict_graphs[key].replay()
        hidden, flat = self.verdict_outputs[key]
        tokens = key[1]
        return hidden[:meta.num_tokens], Verdict(flat, flat[:meta.num_tokens], flat[tokens:tokens + meta.num_reqs],
                                                 tokens)

    def _stage_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      key: tuple[int, int, int], inputs: dict[str, torch.Tensor]) -> None:
        """Copy into the graphs' buffers the step's inputs that `stage` did not write there."""
        num_tokens = meta.num_tokens
        for name, value in inputs.items():
            if value.data_ptr() != self.inputs[name].data_ptr():  # (else written there already)
                self.inputs[name][:num_tokens].copy_(value)
        if input_ids.data_ptr() != self.input_ids.data_ptr():
            self.input_ids[:num_tokens].copy_(input_ids)
        if meta.extra.get("staged") != key:
            self._fill(positions, meta, key)

    def _fill(self, positions: torch.Tensor, meta: AttentionMetadata, key: tuple[int, int, int]) -> None:
        """The step's metadata (device tensors) into the graphs' buffers, and the padding's."""
        n, num_tokens = meta.num_reqs, meta.num_tokens
        batch, tokens, q = key
        width = meta.block_tables.shape[1]
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        if tokens > num_tokens:  # padding tokens write no KV (a call over nothing still costs the host)
            self.slot_mapping[num_tokens:tokens].fill_(PAD_SLOT_ID)
        self.query_start_loc[:n + 1].copy_(meta.query_start_loc)
        if batch > n and q in self.prefill_lens:  # padding requests: no tokens
            self.query_start_loc[n + 1:batch + 1].fill_(num_tokens)
            self.seq_lens[n:batch].fill_(1)
        elif batch > n:  # padding requests: one token each, past the real ones
            torch.add(self._arange[1:batch - n + 1], num_tokens, out=self.query_start_loc[n + 1:batch + 1])
            self.seq_lens[n:batch].fill_(1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)


@dataclass(frozen=True)
class Verdict:
    """A verdict graph's outputs for the step just replayed, on the device: views of one tensor
    (`flat`: the argmax of each of the graph's rows, then each of its requests' accepted count,
    padding's included: one copy to the host takes both)."""

    flat: torch.Tensor
    argmax: torch.Tensor  # [num_tokens] the target's argmax of each of the step's rows
    accepted: torch.Tensor  # [num_reqs] each request's accepted drafts
    accepted_at: int  # where `accepted` starts in `flat`


@dataclass(frozen=True)
class _RegionLayout:
    """Byte offsets of the graphs' integer buffers in their region: input ids, positions, KV slots
    [max_tokens] int64 each, room for a step's further int64 arrays (`stage`'s extras), then
    query_start_loc [max_batch + 1], seq_lens [max_batch] and block tables [max_batch, max_blocks]
    int32; each on a 16-byte boundary."""

    max_tokens: int
    max_batch: int
    max_blocks: int

    @property
    def extras(self) -> int:
        return 3 * 8 * self.max_tokens

    @property
    def extras_len(self) -> int:  # int64 elements: a catch-up's or a step's index arrays
        return 4 * self.max_tokens + 8 * self.max_batch + 64

    @property
    def qsl(self) -> int:
        return self.extras + 8 * self.extras_len

    @property
    def seq_lens(self) -> int:
        return self.qsl + 4 * _aligned(self.max_batch + 1)

    @property
    def tables(self) -> int:
        return self.seq_lens + 4 * _aligned(self.max_batch)

    @property
    def nbytes(self) -> int:
        return self.tables + 4 * self.max_batch * self.max_blocks


def _aligned(n: int) -> int:
    """n int32 elements rounded up to 16 bytes."""
    return -(-n // 4) * 4
