"""FirstUseChecked (kernels/checked.py): a kernel not proven on this GPU and Triton checked against its
reference on its first call; a kernel that raises or disagrees is replaced by the reference for good."""
from __future__ import annotations

import logging

import torch

from tests.kernels.conftest import DEVICE

from specserve.kernels.chain_positions import checked_chain_positions
from specserve.kernels.checked import FirstUseChecked, all_equal
from specserve.kernels.head_input import checked_head_input


def _counting(fn):
    def call(*args):
        call.calls += 1
        return fn(*args)
    call.calls = 0
    return call


def test_an_agreeing_kernel_serves_after_its_check():
    kernel, reference = _counting(lambda x: x * 2), _counting(lambda x: x + x)
    op = FirstUseChecked("double", kernel, reference, all_equal)
    x = torch.arange(5)
    assert torch.equal(op(x), x * 2) and op.use_kernel is True
    assert (kernel.calls, reference.calls) == (2, 1)  # the check's call and the call itself
    op(x)
    assert (kernel.calls, reference.calls) == (3, 1)


def test_a_kernel_that_raises_or_disagrees_is_replaced_by_its_reference(caplog):
    def broken(x):
        raise RuntimeError("PassManager::run failed\nmore")

    for kernel, said, checked in ((broken, "failed on its first call (RuntimeError: PassManager::run failed)", 0),
                                  (lambda x: x * 3, "disagreed with its reference", 1)):
        reference = _counting(lambda x: x + x)
        op = FirstUseChecked("double", kernel, reference, all_equal)
        with caplog.at_level(logging.WARNING, logger="specserve.kernels.checked"):
            caplog.clear()
            assert torch.equal(op(torch.arange(4)), torch.arange(4) * 2)
        assert op.use_kernel is False and said in caplog.text
        op(torch.arange(4))
        assert reference.calls == checked + 2  # the check's (where the kernel ran), then each call's


def test_all_equal_asks_dtype_shape_and_values():
    a = torch.arange(6)
    assert all_equal((a, a.int()), (a.clone(), a.int()))
    assert not all_equal((a, a.int()), (a, a.long()))
    assert not all_equal(a, a.float()) and not all_equal(a, a + 1) and not all_equal((a,), (a, a))


def test_the_chain_positions_and_head_input_kernels_pass_their_checks():
    """The wrappers the chain graphs and the head's forward call: on this device (the interpreter on a CPU)
    each kernel agrees with its reference and serves."""
    tables = torch.randint(0, 50, (3, 6), dtype=torch.int32, device=DEVICE)
    first = torch.tensor([5, 17, 1], dtype=torch.int32, device=DEVICE)
    ks = torch.tensor([4, 2, 0], device=DEVICE)
    checked_chain_positions.use_kernel = None
    checked_chain_positions(first, ks, tables, 8, 3)
    assert checked_chain_positions.use_kernel is True
    gen = torch.Generator().manual_seed(0)
    embed, hidden = torch.randn(20, 72, generator=gen), torch.randn(4, 72, generator=gen)
    w_e, w_h = torch.randn(72, generator=gen), torch.randn(72, generator=gen)
    checked_head_input.use_kernel = None
    out = checked_head_input(torch.tensor([3, 3, 0, 19], device=DEVICE), embed.to(DEVICE), hidden.to(DEVICE),
                             w_e.to(DEVICE), w_h.to(DEVICE), 1e-6)
    assert out.shape == (4, 144) and checked_head_input.use_kernel is True
