"""greedy_pick (Triton, one launch) against torch's argmax and the draft vocabulary's lookup: the
first index of each row's largest value, over rows shorter and longer than a chunk, ties across and
within chunks, written into a column of a larger tensor."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import greedy_pick, ref_greedy_pick
from specserve.kernels.greedy_pick import BLOCK

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("n", [100, BLOCK, 2 * BLOCK + 77])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_vocab", [True, False])
def test_greedy_pick_is_torchs_argmax_and_lookup(n, dtype, with_vocab):
    gen = torch.Generator().manual_seed(n)
    logits = torch.randn(6, n, generator=gen).to(dtype)
    logits[1, :] = 0.5  # every value tied: the first
    logits[2, [3, n - 1]] = 9.0  # a tie across chunks: the first
    logits[3, [n - 1]] = 9.0  # the last column
    logits[4] = torch.round(logits[4] * 2) / 2  # many ties (bf16 and fp32 alike)
    logits, vocab = logits.to(DEVICE), torch.randperm(3 * n, generator=gen)[:n].to(DEVICE)
    drafts = torch.full((6, 3), -7, dtype=torch.long, device=DEVICE)
    expected = drafts.clone()
    v = vocab if with_vocab else None
    ref_greedy_pick(logits, expected[:, 1], v)
    greedy_pick(logits, drafts[:, 1], v)
    assert torch.equal(drafts, expected)  # column 1 only, the rest untouched
    assert int(drafts[2, 1]) == (int(vocab[3]) if with_vocab else 3)
    assert int(drafts[1, 1]) == (int(vocab[0]) if with_vocab else 0)


def test_greedy_pick_refuses_bad_shapes():
    with pytest.raises(ValueError):
        greedy_pick(torch.zeros(4, 8, device=DEVICE).t(), torch.zeros(8, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError):
        greedy_pick(torch.zeros(4, 8, device=DEVICE), torch.zeros(4, dtype=torch.int32, device=DEVICE))
