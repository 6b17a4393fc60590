"""head_input (Triton): an EAGLE head's fc input, bit for bit what `rms_norm` gives on the gathered
embedding rows and the hidden states (the unfused CUDA path), and close to the torch reference."""
from __future__ import annotations

import pytest
import torch

from specserve.kernels import head_input, ref_head_input
from specserve.kernels.head_input import _unfused as unfused  # the CUDA path before the kernel
from specserve.models.layers.basic import RMSNorm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # as test_norm_rotary
EPS = 1e-6


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def make(num_tokens: int, hidden: int, dtype: torch.dtype, vocab: int = 11, strided: bool = False):
    """(input_ids, embed, hidden_states, embed_norm_weight, hidden_norm_weight): ids repeat; strided
    hidden rows are a column slice of a wider tensor."""
    ids = (torch.arange(num_tokens) % 4 * 3).to(DEVICE)  # 0, 3, 6, 9, 0, ...
    hidden_states = rand(num_tokens, hidden + 24, dtype=dtype, seed=1)[:, 10:10 + hidden] if strided \
        else rand(num_tokens, hidden, dtype=dtype, seed=1)
    return ids, rand(vocab, hidden, dtype=dtype), hidden_states, rand(hidden, dtype=dtype, seed=2), \
        rand(hidden, dtype=dtype, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [0, 1, 5])
@pytest.mark.parametrize("with_hidden, strided", [(True, False), (True, True), (False, False)])
def test_head_input_is_unfused_rms_norms_bit_for_bit(dtype, num_tokens, with_hidden, strided):
    ids, embed, hidden_states, w_e, w_h = make(num_tokens, 72, dtype, strided=strided)  # 72: not a power of two
    if not with_hidden:
        hidden_states = None
    got = head_input(ids, embed, hidden_states, w_e, w_h, EPS)
    assert got.shape == (num_tokens, 144) and got.dtype == dtype
    assert torch.equal(got, unfused(ids, embed, hidden_states, w_e, w_h, EPS))  # the two rms_norm launches
    if num_tokens:
        torch.testing.assert_close(got, ref_head_input(ids, embed, hidden_states, w_e, w_h, EPS),
                                   atol=ATOL[dtype], rtol=1e-2)


def test_head_input_matches_the_model_modules():
    ids, embed, hidden_states, w_e, w_h = make(5, 48, torch.float32)
    embed_norm, hidden_norm = RMSNorm(48, EPS).to(DEVICE), RMSNorm(48, EPS).to(DEVICE)
    embed_norm.weight.data, hidden_norm.weight.data = w_e, w_h
    with torch.no_grad():
        want = torch.cat([embed_norm(embed[ids]), hidden_norm(hidden_states)], dim=-1)
        got = head_input(ids, embed, hidden_states, embed_norm.weight, hidden_norm.weight, EPS)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_head_input_reads_strided_int32_ids_and_no_hidden_is_zeros():
    ids, embed, _, w_e, w_h = make(5, 40, torch.float32)
    drafts = torch.zeros(5, 3, dtype=torch.int32, device=DEVICE)
    drafts[:, 1] = ids.to(torch.int32)  # a column of the chain's drafts
    got = head_input(drafts[:, 1], embed, None, w_e, w_h, EPS)
    assert torch.equal(got, head_input(ids, embed, None, w_e, w_h, EPS))
    assert torch.equal(got[:, 40:], torch.zeros(5, 40, device=DEVICE))


def test_bad_inputs_raise_clear_errors():
    ids, embed, hidden_states, w_e, w_h = make(3, 16, torch.float32)
    with pytest.raises(ValueError, match="input_ids must be"):
        head_input(ids.float(), embed, hidden_states, w_e, w_h, EPS)
    with pytest.raises(ValueError, match="input_ids must be"):
        head_input(ids[None], embed, hidden_states, w_e, w_h, EPS)
    with pytest.raises(ValueError, match="embed_weight must be"):
        head_input(ids, embed.t(), hidden_states, w_e, w_h, EPS)
    with pytest.raises(ValueError, match="hidden_states must be"):
        head_input(ids, embed, hidden_states[:2], w_e, w_h, EPS)
    with pytest.raises(ValueError, match="hidden_states must be"):
        head_input(ids, embed, torch.zeros(16, 3, device=DEVICE).t(), w_e, w_h, EPS)
    with pytest.raises(ValueError, match="hidden_norm_weight must be"):
        head_input(ids, embed, hidden_states, w_e, w_h[:8], EPS)
    with pytest.raises(ValueError, match="dtypes differ"):
        head_input(ids, embed, hidden_states.double(), w_e, w_h, EPS)
    with pytest.raises(ValueError, match="dtypes differ"):
        head_input(ids, embed.half(), None, w_e.half(), w_h, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("with_hidden", [True, False])
@pytest.mark.parametrize("num_tokens, hidden", [(1, 576), (4, 4096), (300, 2048), (7, 72)])
def test_gpu_head_input_sweep(num_tokens, hidden, with_hidden):
    ids, embed, hidden_states, w_e, w_h = make(num_tokens, hidden, torch.bfloat16, vocab=50_000, strided=True)
    ids = torch.randint(0, 50_000, (num_tokens,), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    if not with_hidden:
        hidden_states = None
    embed_norm, hidden_norm = RMSNorm(hidden, EPS).to(DEVICE, torch.bfloat16), RMSNorm(hidden, EPS).to(
        DEVICE, torch.bfloat16)
    embed_norm.weight.data, hidden_norm.weight.data = w_e, w_h
    got = head_input(ids, embed, hidden_states, w_e, w_h, EPS)
    with torch.inference_mode():  # the modules' CUDA path: the Triton rms_norm
        e = torch.nn.functional.embedding(ids, embed)
        want = torch.cat([embed_norm(e), hidden_norm(hidden_states if with_hidden else torch.zeros_like(e))], -1)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, ref_head_input(ids, embed, hidden_states, w_e, w_h, EPS),
                               atol=ATOL[torch.bfloat16], rtol=1e-2)
