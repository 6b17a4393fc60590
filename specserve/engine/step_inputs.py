"""A step's inputs on their way to the device: flat ragged token ids, positions, KV slots and the
attention metadata (`batch_metadata`, `build_step_inputs`), through pinned host buffers
(`HostStaging`), and the sampled ids of a step still in flight (`PendingTokens`).

Torch and numpy only: used by the model runner for the target and by the model executor for any
model that runs over the same block ids (a draft model, the start-up cost profile).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from typing import TYPE_CHECKING

from specserve.engine.move_back import move_back_torch
from specserve.engine.outputs import DRAFT_PLACEHOLDER, ScheduledRequest  # noqa: F401 (the runner's name for it)
from specserve.models.layers.attention import PAD_SLOT_ID, AttentionMetadata

if TYPE_CHECKING:
    from specserve.engine.cuda_graphs import StepGraphs


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] rows of the hidden states to project
    logits_rows: list[tuple[ScheduledRequest, int, int]]  # (request, first logits row, count)

    @property
    def every_row_logits(self) -> bool:
        """Does every row take logits (decode, verification: the indices, increasing, are then all rows)?"""
        return len(self.logits_indices) == len(self.input_ids)

    def at_logits_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of `x` [num_tokens, ...] that take logits, in order: [num_logits, ...]. When every
        row takes logits nothing is gathered."""
        return x if self.every_row_logits else x[self.logits_indices]


class HostStaging:
    """Pinned host buffers for a step's integer inputs, so they reach the device in one asynchronous
    copy instead of one blocking copy per tensor (and for sampled ids on their way back). A small
    ring of buffers per dtype (bytes for inputs), each guarded by an event: a buffer is reused only
    once the copy that last used it has run (with async scheduling the next step is built while
    earlier copies may still be queued). Preallocated: allocating pinned memory per step can stall
    on the device."""

    RING = 8

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._ring: dict[torch.dtype, list[list]] = {}  # dtype -> [[buffer, event], ...]
        self._next: dict[torch.dtype, int] = {}
        self.last_event: torch.cuda.Event | None = None
        # the stream copies are queued on (the engine uses its device's current stream throughout),
        # looked up once: `Event.record()` without one looks it up per call, ~35 us on the host
        self._stream: torch.cuda.Stream | None = None

    def _buffer(self, dtype: torch.dtype, total: int) -> list:
        """The next [pinned buffer, event] of the ring, once the copy that last used it has run."""
        ring = self._ring.setdefault(dtype, [[None, None] for _ in range(self.RING)])
        i = self._next.get(dtype, 0)
        self._next[dtype] = (i + 1) % self.RING
        slot = ring[i]
        if slot[1] is not None:
            slot[1].synchronize()
        if slot[0] is None or slot[0].numel() < total:
            slot[0] = torch.empty(max(total, 4096), dtype=dtype, pin_memory=True)
        return slot

    def _copied(self, slot: list) -> None:
        if self._stream is None:
            self._stream = torch.cuda.current_stream(self.device)
        slot[1] = self.last_event = torch.cuda.Event()
        slot[1].record(self._stream)

    def host_buffer(self, nbytes: int) -> tuple[np.ndarray, list]:
        """A host buffer of at least `nbytes` bytes (a uint8 numpy view) to fill and then `upload`,
        and its handle (a ring slot, pinned, on CUDA; a fresh buffer on the CPU)."""
        if not self.pinned:
            buffer = np.zeros(nbytes, dtype=np.uint8)
            return buffer, [torch.from_numpy(buffer), None]
        slot = self._buffer(torch.uint8, nbytes)
        return slot[0].numpy(), slot

    def upload(self, dst: torch.Tensor, handle: list, nbytes: int) -> None:
        """Copy the first `nbytes` of a `host_buffer` into `dst` (uint8, on the device)."""
        dst.copy_(handle[0][:nbytes], non_blocking=self.pinned)
        if self.pinned:
            self._copied(handle)

    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pinned host views that the device tensors (1-D, one dtype) are being copied into; valid
        once `last_event` has completed."""
        offsets, total = _layout([t.numel() for t in tensors], tensors[0].element_size())
        slot = self._buffer(tensors[0].dtype, total)
        out = [slot[0][o:o + t.numel()] for o, t in zip(offsets, tensors)]
        for t, view in zip(tensors, out):
            view.copy_(t, non_blocking=True)
        self._copied(slot)
        return out

    def to_device(self, arrays: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        """Device tensors (views of one copy) holding `arrays` (1-D numpy, any int dtype) as `dtype`."""
        return self.to_device_groups([(arrays, dtype)])[0]

    def to_device_groups(self, groups: list[tuple[list[np.ndarray], torch.dtype]]) -> list[list[torch.Tensor]]:
        """`to_device` for several dtypes in one copy: per group (arrays, dtype), device tensors
        holding its arrays (1-D numpy, any int dtype) as that dtype, all views of one buffer, each
        starting on a 16-byte boundary: Triton compiles a kernel variant per alignment class of its
        pointer arguments, so views at odd offsets would cost a compile (a stalled step) the first
        time each class shows up. One copy, not one per dtype: each costs the host a buffer, a
        launch and an event (tens of microseconds, on the path of every step)."""
        layouts, nbytes = [], 0
        for arrays, dtype in groups:
            size = dtype.itemsize
            offsets, total = _layout([len(a) for a in arrays], size)
            layouts.append((nbytes, offsets, total * size))
            nbytes += total * size  # a multiple of ALIGN_BYTES: the next group starts aligned
        if not self.pinned:  # the CPU: the tensors view one host buffer
            flat = host = torch.zeros(nbytes, dtype=torch.uint8)
        else:
            slot = self._buffer(torch.uint8, nbytes)
            host = slot[0]
        for (arrays, dtype), (start, offsets, length) in zip(groups, layouts):
            view = host[start:start + length].view(dtype).numpy()
            for a, o in zip(arrays, offsets):
                view[o:o + len(a)] = a
        if self.pinned:
            flat = host[:nbytes].to(self.device, non_blocking=True)
            self._copied(slot)
        out = []
        for (arrays, dtype), (start, offsets, length) in zip(groups, layouts):
            typed = flat[start:start + length].view(dtype)
            out.append([typed[o:o + len(a)] for o, a in zip(offsets, arrays)])
        return out


ALIGN_BYTES = 16


def _layout(sizes: list[int], elem_size: int) -> tuple[list[int], int]:
    """Offsets (in elements) of consecutive arrays of these sizes, each on an ALIGN_BYTES boundary,
    and the total length."""
    step = max(1, ALIGN_BYTES // elem_size)
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // step) * step
    return offsets, end


_DEFAULT_STAGING: dict[torch.device, HostStaging] = {}


def _staging_for(device: torch.device) -> HostStaging:
    staging = _DEFAULT_STAGING.get(device)
    if staging is None:
        staging = _DEFAULT_STAGING[device] = HostStaging(device)
    return staging


def _padded_tables(tables: list[list[int]], min_width: int = 0) -> np.ndarray:
    """Block tables as one zero-padded [num_reqs, max(len, min_width)] int64 array."""
    out = np.zeros((len(tables), max(max(len(t) for t in tables), min_width)), dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def batch_metadata(query_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int,
                   device: torch.device, pad_block_table_to: int = 0, staging: HostStaging | None = None,
                   extra_int64: list[np.ndarray] = (), padding_from: int | None = None,
                   graphs: StepGraphs | None = None, input_ids: np.ndarray | None = None,
                   prev_slots: int | None = None) -> tuple[torch.Tensor, AttentionMetadata, list[torch.Tensor]]:
    """Positions [num_tokens] and attention metadata of a flat ragged batch: request i computes the
    last query_lens[i] of its seq_lens[i] tokens, whose KV lives in the blocks tables[i].
    `extra_int64` arrays travel to the device in the same copy; they come back as the third result
    (after the token ids, when `input_ids` are given). `padding_from`: the tokens from this one on
    are padding, whose KV is not written (PAD_SLOT_ID). `graphs`: the executor's CUDA graphs; a
    step one of them runs is written straight into their buffers (`StepGraphs.stage`). `prev_slots`:
    also the KV slot of each token's previous position (where an EAGLE head's entry reads the target's
    hidden state), this row for position 0 and for padding tokens, first of the extra arrays."""
    staging = staging or _staging_for(device)
    num_reqs = len(query_lens)
    q_lens = np.asarray(query_lens, dtype=np.int64)
    s_lens = np.asarray(seq_lens, dtype=np.int64)
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    block_tables = _padded_tables(tables, pad_block_table_to)
    max_blocks = block_tables.shape[1]
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)
    positions = np.arange(num_tokens) - (cu[:-1] - s_lens + q_lens)[req_of_token]
    slots = block_tables[req_of_token, positions // block_size] * block_size + positions % block_size
    if prev_slots is not None:
        prev = positions - 1
        sources = np.where(prev >= 0, block_tables[req_of_token, np.maximum(prev, 0) // block_size] * block_size
                           + prev % block_size, prev_slots)
        if padding_from is not None:
            sources[padding_from:] = prev_slots
        extra_int64 = [sources, *extra_int64]
    if padding_from is not None:
        slots[padding_from:] = PAD_SLOT_ID
    max_query_len = int(q_lens.max())
    key = graphs.key(num_reqs, max_query_len, num_tokens) if graphs is not None else None
    staged = key is not None and graphs.stage(key, staging, positions, slots, cu, s_lens, block_tables,
                                              list(extra_int64), input_ids)
    if staged:
        ids_d, positions_d, slots_d, cu_d, s_lens_d, bt_d, *extras = staged
        if input_ids is not None:
            extras.insert(0, ids_d)
    else:
        key = None
        arrays = [positions, slots, *([] if input_ids is None else [input_ids]), *extra_int64]
        (positions_d, slots_d, *extras), (cu_d, s_lens_d, bt_d) = staging.to_device_groups(
            [(arrays, torch.int64), ([cu, s_lens, block_tables.ravel()], torch.int32)])
        bt_d = bt_d.view(num_reqs, max_blocks)
    meta = AttentionMetadata(
        num_reqs=num_reqs, num_tokens=num_tokens, max_query_len=max_query_len,
        max_seq_len=int(s_lens.max()), query_start_loc=cu_d, seq_lens=s_lens_d,
        block_tables=bt_d, slot_mapping=slots_d, query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
        block_size=block_size, extra={} if key is None else {"staged": key})
    return positions_d, meta, extras


def chain_metadata(seq_lens: list[int], num_active: list[int], tables: list[list[int]], block_size: int,
                   device: torch.device, staging: HostStaging | None = None
                   ) -> list[tuple[torch.Tensor, AttentionMetadata]]:
    """Positions and attention metadata of consecutive one-token steps of the same requests (a
    proposer's chain of drafts), built and uploaded at once. Step j (0-based) computes one token at
    position seq_lens[i] + j for requests i < num_active[j] (non-increasing: the requests with the
    most steps come first)."""
    staging = staging or _staging_for(device)
    num_reqs, num_steps = len(seq_lens), len(num_active)
    s0 = np.asarray(seq_lens, dtype=np.int64)
    block_tables = _padded_tables(tables)
    positions = s0[None, :] + np.arange(num_steps)[:, None]  # [steps, reqs]
    active = np.arange(num_reqs)[None, :] < np.asarray(num_active)[:, None]
    blocks = np.where(active, positions // block_size, 0)  # steps past a request's own are never read
    slots = np.take_along_axis(block_tables.T, blocks, axis=0) * block_size + positions % block_size
    (pos_d, slots_d), (cu_d, lens_d, bt_d) = staging.to_device_groups(
        [([positions.ravel(), slots.ravel()], torch.int64),
         ([np.arange(num_reqs + 1), (positions + 1).ravel(), block_tables.ravel()], torch.int32)])
    bt_d = bt_d.view(num_reqs, -1)
    steps = []
    for j, n in enumerate(num_active):
        row = slice(j * num_reqs, j * num_reqs + n)
        lens = positions[j, :n] + 1
        steps.append((pos_d[row], AttentionMetadata(
            num_reqs=n, num_tokens=n, max_query_len=1, max_seq_len=int(lens.max()), query_start_loc=cu_d[:n + 1],
            seq_lens=lens_d[row], block_tables=bt_d[:n], slot_mapping=slots_d[row], query_lens_cpu=[1] * n,
            seq_lens_cpu=lens.tolist(), block_size=block_size)))
    return steps


def build_step_inputs(scheduled: list[ScheduledRequest], block_size: int, device: torch.device,
                      pad_block_table_to: int = 0, staging: HostStaging | None = None,
                      prev_tokens: PendingTokens | None = None, drafts: DraftsInFlight | None = None,
                      graphs: StepGraphs | None = None) -> StepInputs:
    """Flat token ids / positions / slots and the attention metadata of one step. A request whose
    last token is still in flight (async scheduling) gets it from `prev_tokens` on the device, and
    one whose drafts are (placeholders on the host) gets them from `drafts` there."""
    input_ids: list[int] = []
    query_lens, seq_lens, tables = [], [], []
    logits_idx: list[int] = []
    logits_rows = []
    fill_dst: list[int] = []  # flat positions whose token id is on the device ...
    fill_src: list[int] = []  # ... in this row of prev_tokens
    draft_dst: list[int] = []  # flat positions whose draft is on the device ...
    draft_src: list[int] = []  # ... at this index of drafts.tokens
    for s in scheduled:
        req = s.request
        num_real = s.num_tokens - len(s.spec_token_ids)
        known = req.all_token_ids[s.start:s.start + num_real]
        input_ids += known
        if len(known) < num_real:  # the in-flight token(s) of the previous step
            assert prev_tokens is not None and num_real - len(known) == 1, "one token in flight at most"
            fill_dst.append(len(input_ids))
            fill_src.append(prev_tokens.row_of[req.request_id])
            input_ids.append(0)
        if drafts is not None and s.spec_token_ids and req.request_id in drafts.row_of:
            offset = drafts.row_of[req.request_id]
            draft_dst += range(len(input_ids), len(input_ids) + len(s.spec_token_ids))
            draft_src += range(offset, offset + len(s.spec_token_ids))
        input_ids += s.spec_token_ids
        query_lens.append(s.num_tokens)
        seq_lens.append(s.start + s.num_tokens)
        tables.append(s.block_ids)
        if s.sample:
            count = 1 + len(s.spec_token_ids)
            end = len(input_ids)
            logits_rows.append((s, len(logits_idx), count))
            logits_idx += range(end - count, end)
    extra = [np.asarray(a, dtype=np.int64) for a in (logits_idx, fill_dst, fill_src, draft_dst, draft_src)]
    positions, meta, (ids, logits_indices, dst, src, ddst, dsrc) = batch_metadata(
        query_lens, seq_lens, tables, block_size, device, pad_block_table_to, staging, extra, graphs=graphs,
        input_ids=np.asarray(input_ids, dtype=np.int64))
    if fill_dst:
        ids[dst] = prev_tokens.tokens[src]
    if draft_dst:
        _take(ids, draft_dst, ddst, drafts.tokens, draft_src, dsrc)
    return StepInputs(input_ids=ids, positions=positions, meta=meta, logits_indices=logits_indices,
                      logits_rows=logits_rows)


def _take(out: torch.Tensor, dst: list[int], dst_d: torch.Tensor, src: torch.Tensor, src_rows: list[int],
          src_d: torch.Tensor) -> None:
    """out[dst] = src[src_rows] (dst_d, src_d: those index lists on the device). Where both are runs of
    consecutive indices (one drafting request: its drafts into its step's rows) one slice copy does
    it, where a gather and a scatter took two launches (~10 us of host time each on an H200's host,
    on the path of every drafting step at one request)."""
    n, d, r = len(dst), dst[0], src_rows[0]
    if dst == list(range(d, d + n)) and src_rows == list(range(r, r + n)):
        out[d:d + n].copy_(src[r:r + n])
    else:
        out[dst_d] = src[src_d]


@dataclass
class PendingTokens:
    """Token ids sampled by a launched step, still on the device (one per sampled request), and
    their copy on its way to the host."""

    tokens: torch.Tensor  # [num_rows] int64, device
    row_of: dict[str, int]  # request id -> row
    host: torch.Tensor  # [num_rows] int64, host (pinned on CUDA), valid once `event` completed
    event: torch.cuda.Event | None


@dataclass
class DraftsInFlight:
    """Drafts a step made on the device for the next one: the next step's inputs take them there
    (`build_step_inputs`), and their host copy replaces the scheduler's placeholders later."""

    tokens: torch.Tensor  # [num_drafting * K] int64, device: each drafting request's row of K
    row_of: dict[str, int]  # request id -> the offset of its row in `tokens`
    requests: dict  # request id -> its Request (whose `spec_token_ids` hold placeholders)
    host: torch.Tensor  # `tokens` on the host (pinned on CUDA), valid once `event` completed
    event: torch.cuda.Event | None


@dataclass
class StepAhead:
    """The inputs of a step scheduled before its predecessor's tokens were known (async drafting:
    `Scheduler.schedule_ahead`): the host placed each request as if every draft of the predecessor
    were accepted; on the device each is `back` positions behind that (the drafts it rejected). The
    step's inputs take the predecessor's last tokens (`tokens`: the target's token after its accepted
    drafts) and its drafts (`drafts`) on the device. A request the predecessor verified no drafts of
    is where the host placed it (`in_place`: its back is 0). The predecessor's requests lead the step
    in its order; requests admitted in the step follow them (where the host placed them: back 0)."""

    tokens: PendingTokens
    drafts: DraftsInFlight
    back: torch.Tensor  # [num_rows] int64, device: per row of the step's logits (a sampling request), in its order
    rows: torch.Tensor  # [num_tokens] int64, device: the request of each of the predecessor's requests' tokens
    in_place: frozenset[str] = frozenset()  # ids of the requests whose back is 0, known on the host

    def move_back(self, positions: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor,
                  reqs: torch.Tensor | None = None, sources: torch.Tensor | None = None) -> None:
        """Move a batch built at the host's positions (the step's, or a proposer's over the same
        positions) back where the device has its requests, in place: positions, KV slots (from the
        block tables) and context lengths; padding past them is left as it is. `rows`: each token's
        request in the batch (its row of the block tables); `reqs`: each of the batch's requests in
        the step (None: the same); `sources`: also write there each token's previous position's slot.
        One Triton launch on CUDA (kernels/move_back.py), torch ops elsewhere."""
        args = (positions, meta.slot_mapping, meta.seq_lens, meta.block_tables, meta.block_size, rows, self.back,
                reqs, sources)
        if positions.is_cuda:
            from specserve.kernels.move_back import move_back

            move_back(*args)
        else:
            move_back_torch(*args)
