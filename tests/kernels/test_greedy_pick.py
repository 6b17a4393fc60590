"""greedy_pick (Triton) against torch's argmax and the draft vocabulary's lookup: the first index
of each row's largest value, over rows shorter and longer than a chunk, and long enough to be split
over programs, ties across and within chunks, written into a column of a larger tensor;
linear_greedy_pick (the LM head's product and the pick, no logits in memory) against torch's product
and argmax."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import greedy_pick, linear_greedy_pick, ref_greedy_pick, ref_linear_greedy_pick
from specserve.kernels.greedy_pick import BLOCK, MAX_FUSED_ROWS

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("n", [100, BLOCK, 2 * BLOCK, 2 * BLOCK + 77, 6 * BLOCK + 5])
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


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("n", [64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_greedy_pick_is_the_products_argmax(rows, n, dtype):
    """Weights and hidden states on a grid of 1/8 (every sum exact in fp32; the bf16 logits then
    round alike however they are summed): many ties within and across the kernel's vocabulary blocks,
    the first wins; vocabularies not a multiple of a block; batches over one and several row blocks."""
    gen = torch.Generator().manual_seed(rows * n)
    k = 72  # not a multiple of the kernel's K block
    hidden = (torch.randint(-8, 9, (rows, k), generator=gen) / 8).to(dtype)
    weight = (torch.randint(-3, 4, (n, k), generator=gen) / 8).to(dtype)
    weight[n - 1] = weight[2]  # a tie across blocks (n > 64): the first
    hidden[0] = 0  # every logit 0: index 0
    hidden, weight = hidden.to(DEVICE), weight.to(DEVICE)
    vocab = torch.randperm(2 * n, generator=gen)[:n].to(DEVICE)
    for v in (vocab, None):
        drafts = torch.full((rows, 3), -7, dtype=torch.long, device=DEVICE)
        expected = drafts.clone()
        ref_linear_greedy_pick(hidden, weight, expected[:, 2], v)
        linear_greedy_pick(hidden, weight, drafts[:, 2], v)
        assert torch.equal(drafts, expected)
        assert int(drafts[0, 2]) == (int(vocab[0]) if v is not None else 0)


def test_linear_greedy_pick_on_random_weights_picks_a_largest_logit():
    """Random fp32 values (sums rounded in any order): the picked row's logit is the largest, to
    the last bits of fp32, and almost every pick is torch's."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(24, 96, generator=gen).to(DEVICE), torch.randn(1000, 96, generator=gen).to(DEVICE)
    picked = linear_greedy_pick(hidden, weight, torch.empty(24, dtype=torch.long, device=DEVICE))
    logits = hidden @ weight.T
    assert torch.allclose(logits.gather(1, picked[:, None]).squeeze(1), logits.max(dim=1).values, rtol=1e-5, atol=1e-5)
    assert (picked == logits.argmax(dim=1)).sum() >= 23


def test_linear_greedy_pick_refuses_bad_shapes():
    h, w, out = torch.zeros(4, 8, device=DEVICE), torch.zeros(16, 8, device=DEVICE), torch.zeros(4, dtype=torch.long,
                                                                                                  device=DEVICE)
    with pytest.raises(ValueError, match="one float dtype"):
        linear_greedy_pick(h, w.to(torch.bfloat16), out)
    with pytest.raises(ValueError):
        linear_greedy_pick(h, torch.zeros(16, 9, device=DEVICE), out)
    with pytest.raises(ValueError):
        linear_greedy_pick(h, w.t().contiguous().t(), out)
    with pytest.raises(ValueError):
        linear_greedy_pick(h, w, out[:3])


@pytest.mark.parametrize("rows", [3, MAX_FUSED_ROWS + 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shipped_heads_greedy_pick_is_its_logits_argmax(dtype, rows):
    """`EagleHead.pick_greedy` (the chains' pick on CUDA) on the shipped head's shape (8,192 draft
    rows of 576): its logits' argmax looked up, through the product-and-pick over a few rows and
    through torch's product over more."""
    from specserve.spec_decode.eagle_head import HEADS_DIR, load_head

    head = load_head(HEADS_DIR / "SmolLM2-135M-Instruct", dtype=dtype, device=DEVICE, max_positions=64)
    gen = torch.Generator().manual_seed(1)
    vocab, h = head.cfg.vocab_size, head.cfg.hidden_size
    head.attach(torch.randn(vocab, h, generator=gen).to(dtype).to(DEVICE),
                (torch.randint(-4, 5, (vocab, h), generator=gen) / 16).to(dtype).to(DEVICE))
    g = (torch.randint(-4, 5, (rows, h), generator=gen) / 16).to(dtype).to(DEVICE)  # exact sums: no rounding ties
    drafts = torch.zeros(rows, 2, dtype=torch.long, device=DEVICE)
    head.pick_greedy(g, drafts[:, 1])
    assert torch.equal(drafts[:, 1], head.draft_vocab[head.compute_logits(g).argmax(dim=1)])
    assert not drafts[:, 0].any()
