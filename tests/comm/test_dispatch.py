"""Expert parallelism's collectives on real gloo processes (seqpar.comm.dispatch): all_to_all_rows
moves uneven row counts (zero included) in one all_to_all_single per direction, its backward returns
every row's gradient to the rank and slot it came from (checked against the same exchange done on
the whole data); a rank whose input needs no gradient still joins the backward exchange; the
per-expert counts arrive as each owner needs them, and ranks that disagree on the row width raise
the same ValueError on every rank instead of exchanging mismatched rows."""

import pytest
import torch
import torch.distributed as dist

from seqpar.comm.counting import count_collectives
from seqpar.comm.dispatch import all_to_all_rows, exchange_counts
from seqpar.comm.launch import run_distributed

pytestmark = pytest.mark.distributed


def _counts(world, seed):
    """``counts[s][d]``: rows rank s sends rank d (zeros included)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 4, (world, world), generator=g)
    c[seed % world] = 0  # one rank sends nothing
    return c.tolist()


def _rows(s, n):
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(100 + s), dtype=torch.float64)


def _worker(rank, world):
    group, out = dist.group.WORLD, {}
    for seed in range(4):
        c = _counts(world, seed)
        x = _rows(rank, sum(c[rank])).requires_grad_(seed != 1 or rank != 0)  # seed 1: rank 0 needs no grad
        with count_collectives() as fwd:
            y = all_to_all_rows(x, c[rank], [c[s][rank] for s in range(world)], group=group)
        # what rank `rank` must receive: rank s's rows for it, rank 0's first
        want = torch.cat([_rows(s, sum(c[s])).split(c[s])[rank] for s in range(world)])
        out[f"fwd {seed}"] = float((y - want).abs().max()) if want.numel() else float(y.numel())
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)
        with count_collectives() as bwd:
            (y * w).sum().backward()
        out[f"calls {seed}"] = (fwd["all_to_all_single"], bwd["all_to_all_single"])
        if x.requires_grad:  # row i of x went to some rank d: its gradient is d's weight of that row
            ws = [torch.randn(sum(c[s][d] for s in range(world)), 3, generator=torch.Generator().manual_seed(7 + d),
                              dtype=torch.float64) for d in range(world)]
            want_g = torch.cat([ws[d].split([c[s][d] for s in range(world)])[rank] for d in range(world)])
            out[f"bwd {seed}"] = float((x.grad - want_g).abs().max()) if x.numel() else 0.0
    # counts: every rank owns experts [2, 1, 1, ...][:world] (uneven), sends counts of each
    owned = [2] + [1] * (world - 1)
    mine = torch.arange(sum(owned)) * 10 + rank  # rows of this rank per expert
    recv = exchange_counts(mine, owned, group=group, check=32)
    start = sum(owned[:rank])
    out["counts"] = recv == [[e * 10 + s for e in range(start, start + owned[rank])] for s in range(world)]
    try:
        exchange_counts(mine, owned, group=group, check=32 if rank else 16)
        out["width"] = None
    except ValueError as e:
        out["width"] = str(e)
    try:
        all_to_all_rows(torch.zeros(2, 3), [1] * world, [1] * world, group=group)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def test_rows_travel_both_ways_exactly():
    for out in run_distributed(_worker, 3, timeout=300):
        for key, err in out.items():
            if key.startswith(("fwd", "bwd")):
                assert err == 0.0, (key, err)  # a move, no arithmetic: the same bits
            if key.startswith("calls"):
                assert err == (1, 1), (key, err)  # one all_to_all_single per direction
        assert out["counts"] is True
        assert "disagree on the width of the rows" in out["width"] and "[16, 32, 32]" in out["width"], out
        assert "send_counts [1, 1, 1] sum to 3, but x has 2 rows" in out["mismatch"]
