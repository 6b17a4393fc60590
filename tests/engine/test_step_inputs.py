"""Host staging: a step's integer arrays reach the device as views of one copy, each on a 16-byte
boundary (Triton compiles a kernel variant per alignment class of its pointer arguments, so a view at
an odd offset would stall the first step that meets it with a compile)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.engine.step_inputs import ALIGN_BYTES, HostStaging, batch_metadata

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_staged_views_are_aligned_and_hold_the_arrays(device, dtype):
    staging = HostStaging(torch.device(device))
    rng = np.random.default_rng(0)
    for sizes in ([1], [3, 5, 1], [2, 0, 7, 4], [17, 1, 1, 33]):
        arrays = [rng.integers(-5, 1000, n) for n in sizes]
        views = staging.to_device(arrays, dtype)
        assert [v.dtype for v in views] == [dtype] * len(arrays)
        for a, v in zip(arrays, views):
            assert v.data_ptr() % ALIGN_BYTES == 0
            assert v.cpu().tolist() == a.tolist()



@pytest.mark.parametrize("device", DEVICES)
def test_groups_of_dtypes_travel_in_one_copy(device):
    """int64 and int32 arrays staged together are views of one buffer (one copy), each of its dtype, on a
    16-byte boundary, with the right values; a ring slot is reused for later steps without mixing them."""
    staging = HostStaging(torch.device(device))
    rng = np.random.default_rng(1)
    for sizes64, sizes32 in (([3], [1, 2]), ([1, 0, 5], [7]), ([9, 1], [3, 3, 3])):
        a64 = [rng.integers(-5, 1 << 40, n) for n in sizes64]
        a32 = [rng.integers(-5, 1 << 30, n) for n in sizes32]
        v64, v32 = staging.to_device_groups([(a64, torch.int64), (a32, torch.int32)])
        assert [v.dtype for v in v64] == [torch.int64] * len(a64) and [v.dtype for v in v32] == [torch.int32] * len(a32)
        base = {v.untyped_storage().data_ptr() for v in v64 + v32}
        assert len(base) == 1, "not one buffer"
        for a, v in zip(a64 + a32, v64 + v32):
            assert v.data_ptr() % ALIGN_BYTES == 0
            assert v.cpu().tolist() == a.tolist()

def test_step_metadata_keeps_every_array_aligned():
    """An odd number of tokens and requests (the case that used to put the slot mapping, the sequence
    lengths and the block tables at odd offsets) gives aligned tensors with the right values."""
    positions, meta, (extra,) = batch_metadata([3, 1, 1], [3, 9, 20], [[4], [7, 2], [1, 5, 6]], 8,
                                               torch.device("cpu"), extra_int64=[np.arange(5)])
    for t in (positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables, extra):
        assert t.data_ptr() % ALIGN_BYTES == 0
    assert positions.tolist() == [0, 1, 2, 8, 19]
    assert meta.slot_mapping.tolist() == [32, 33, 34, 16, 51]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 5] and meta.seq_lens.tolist() == [3, 9, 20]
    assert meta.block_tables.tolist() == [[4, 0, 0], [7, 2, 0], [1, 5, 6]] and extra.tolist() == list(range(5))


@pytest.mark.parametrize("dst,src_rows", [([1, 2, 3], [4, 5, 6]), ([5], [0]), ([1, 2, 5, 6], [0, 1, 2, 3]),
                                          ([1, 2, 3], [2, 1, 0]), ([0, 1, 2], [0, 2, 4])])
def test_drafts_in_flight_reach_their_rows_by_one_copy_or_by_index(monkeypatch, dst, src_rows):
    """The drafts a step takes on the device (`_take`) land where indexing puts them, whether their
    rows are one run each (one drafting request: a slice copy) or not (a gather and a scatter)."""
    from specserve.engine import step_inputs

    out, src = torch.zeros(8, dtype=torch.long), torch.arange(100, 108)
    expected = out.clone()
    expected[torch.tensor(dst)] = src[torch.tensor(src_rows)]
    launches = []
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, other, _copy=torch.Tensor.copy_: launches.append(1) or
                        _copy(self, other))
    step_inputs._take(out, dst, torch.tensor(dst), src, src_rows, torch.tensor(src_rows))
    assert torch.equal(out, expected)
    n = len(dst)
    runs = dst == list(range(dst[0], dst[0] + n)) and src_rows == list(range(src_rows[0], src_rows[0] + n))
    assert bool(launches) == runs
