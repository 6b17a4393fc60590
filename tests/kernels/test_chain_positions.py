"""chain_positions (Triton: an EAGLE chain's step inputs for all its steps in one launch) against its torch
reference (spec_decode/eagle_chain.py): requests with k drafts, fewer than the chain's, none (padding),
contexts crossing blocks, block tables that are a slice of a wider buffer, more requests than one program
takes."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import chain_positions, ref_chain_positions
from specserve.models.layers.attention import PAD_SLOT_ID

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("num_reqs", [1, 7, 130])
@pytest.mark.parametrize("block_size", [4, 16])
def test_chain_positions_are_the_references(k, num_reqs, block_size):
    gen = torch.Generator().manual_seed(k * 1000 + num_reqs + block_size)
    width = 9
    ks = torch.randint(0, k + 1, (num_reqs,), generator=gen)  # 0: padding, below k: a shorter chain
    firsts = torch.randint(1, block_size * width - k, (num_reqs,), generator=gen).to(torch.int32)
    buffer = torch.randint(0, 1000, (num_reqs + 3, width + 5), generator=gen, dtype=torch.int32)
    tables = buffer[:num_reqs, :width]  # rows width + 5 apart, as the chain graphs' buffer slices them
    want = ref_chain_positions(firsts, ks, tables.contiguous(), block_size, torch.arange(k - 1).unsqueeze(1),
                               (torch.arange(num_reqs) * width).unsqueeze(0))
    got = chain_positions(firsts.to(DEVICE), ks.to(DEVICE), tables.to(DEVICE), block_size, k - 1)
    for g, w in zip(got, want):
        assert g.shape == (k - 1, num_reqs) and g.dtype == w.dtype and g.is_contiguous()
        assert torch.equal(g.cpu(), w)
    assert (got[1].cpu()[:, ks == 0] == PAD_SLOT_ID).all()  # padding writes nothing


def test_chain_positions_refuses_mismatched_rows():
    with pytest.raises(ValueError):
        chain_positions(torch.ones(3, dtype=torch.int32, device=DEVICE), torch.ones(2, dtype=torch.long, device=DEVICE),
                        torch.zeros(3, 4, dtype=torch.int32, device=DEVICE), 16, 2)
    with pytest.raises(ValueError):
        chain_positions(torch.ones(3, dtype=torch.int32, device=DEVICE), torch.ones(3, dtype=torch.long, device=DEVICE),
                        torch.zeros(4, 3, dtype=torch.int32, device=DEVICE).t(), 16, 2)
