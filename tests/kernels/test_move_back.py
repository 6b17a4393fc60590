"""move_back (Triton, one launch) against ref_move_back (the engine's torch ops) and a plain loop:
a step built ahead of its predecessor's tokens moved back where its requests stand (async drafting)."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.kernels import move_back, ref_move_back, warm_up_move_back

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_case(rng: random.Random, num_reqs: int, block_size: int, subset: bool, padding: int):
    """A batch of `num_reqs` requests (plus `padding` rows of tokens and requests past them that must
    not move) built `back` positions ahead; `reqs` maps the batch's requests into `back` (a subset of
    a larger step's requests) or is None."""
    q_lens = [rng.randint(1, 6) for _ in range(num_reqs)]
    width = 40
    tables = torch.randint(0, 1000, (num_reqs + 1, width), dtype=torch.int32)
    back_len = num_reqs + 3 if subset else num_reqs
    back = torch.tensor([rng.randint(0, 5) for _ in range(back_len)])
    reqs = torch.tensor(rng.sample(range(back_len), num_reqs)) if subset else None
    behind = back if reqs is None else back[reqs]
    rows = torch.tensor([r for r, q in enumerate(q_lens) for _ in range(q)])
    seq_lens = torch.tensor([int(b) + q + rng.randint(1, 150) for b, q in zip(behind, q_lens)] + [7] * padding,
                            dtype=torch.int32)
    positions = torch.cat([torch.arange(int(s) - q, int(s)) for s, q in zip(seq_lens, q_lens)] +
                          [torch.zeros(padding, dtype=torch.long)])
    slots = torch.full((len(positions),), -1, dtype=torch.long)
    sources = torch.full((len(positions),), 99, dtype=torch.long)
    return positions, slots, seq_lens, tables, rows, back, reqs, sources


def oracle(positions, slots, seq_lens, tables, block_size, rows, back, reqs, sources):
    positions, slots, seq_lens, sources = positions.clone(), slots.clone(), seq_lens.clone(), sources.clone()
    for t, r in enumerate(rows.tolist()):
        b = int(back[r if reqs is None else reqs[r]])
        p = int(positions[t]) - b
        positions[t] = p
        slots[t] = int(tables[r, p // block_size]) * block_size + p % block_size
        sources[t] = int(tables[r, (p - 1) // block_size]) * block_size + (p - 1) % block_size
    for r in range(len(back) if reqs is None else len(reqs)):
        seq_lens[r] -= int(back[r if reqs is None else reqs[r]])
    return positions, slots, seq_lens, sources


@pytest.mark.parametrize("subset", [False, True], ids=["every-request", "subset"])
@pytest.mark.parametrize("with_sources", [False, True])
def test_move_back_matches_the_torch_ops_and_a_loop(subset, with_sources):
    rng = random.Random(int(subset) * 2 + int(with_sources))
    for trial in range(12):
        block_size = rng.choice([8, 16])
        case = make_case(rng, rng.randint(1, 9), block_size, subset, padding=rng.randint(0, 3))
        positions, slots, seq_lens, tables, rows, back, reqs, sources = case
        want = oracle(positions, slots, seq_lens, tables[:-1], block_size, rows, back, reqs, sources)
        got = {}
        for name, fn, device in (("torch", ref_move_back, torch.device("cpu")), ("triton", move_back, DEVICE)):
            t = [x.clone().to(device) if x is not None else None for x in case]
            p, s, lens, tab, rw, bk, rq, src = t
            fn(p, s, lens, tab[:-1], block_size, rw, bk, rq, src if with_sources else None)
            got[name] = (p.cpu(), s.cpu(), lens.cpu(), src.cpu())
        for name, (p, s, lens, src) in got.items():
            assert torch.equal(p, want[0]) and torch.equal(s, want[1]), (trial, name)  # padding rows unmoved
            assert torch.equal(lens, want[2]), (trial, name)
            assert torch.equal(src, want[3] if with_sources else sources), (trial, name)


def test_warm_up_compiles_the_variants_the_engine_launches():
    warm_up_move_back(DEVICE, 16)
