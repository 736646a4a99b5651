"""route_rows on real gloo processes: each rank sends chosen rows of its tensor to chosen ranks in one
all_to_all_single; values and gradients against the same routing done on the whole (unsharded)
data. Uneven counts, ranks that send or receive nothing, a row sent to two ranks (its gradient is
the sum), and an input that needs no gradient on one rank (the backward exchange still runs on
every rank, so nobody waits)."""

import pytest
import torch
import torch.distributed as dist

from seqpar.comm.counting import count_collectives
from seqpar.comm.launch import run_distributed
from seqpar.comm.route import route_rows

pytestmark = pytest.mark.distributed


def _plan(world, seed):
    """Rows per rank and, for each (source, dest), the source rows dest gets (random, with repeats)."""
    g = torch.Generator().manual_seed(seed)
    n = [int(torch.randint(0, 5, (1,), generator=g)) for _ in range(world)]
    sends = [[torch.randint(0, max(n[s], 1), (int(torch.randint(0, 4, (1,), generator=g)) if n[s] else 0,),
                            generator=g) for _ in range(world)] for s in range(world)]
    return n, sends


def _worker(rank, world):
    group = dist.group.WORLD
    errs, calls = {}, {}
    for seed in range(6):
        n, sends = _plan(world, seed)
        full = [torch.randn(n[s], 3, generator=torch.Generator().manual_seed(100 + s), dtype=torch.float64)
                for s in range(world)]
        x = full[rank].clone().requires_grad_(seed != 2 or rank != 0)  # seed 2: rank 0's input needs no grad
        recv = [len(sends[s][rank]) for s in range(world)]
        with count_collectives() as c_fwd:
            out = route_rows(x, sends[rank], recv, group=group)
        want = torch.cat([full[s][sends[s][rank]] for s in range(world)])
        errs[f"fwd {seed}"] = float((out - want).abs().max()) if want.numel() else float(out.numel())
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)
        with count_collectives() as c_bwd:
            (out * w).sum().backward()
        calls[seed] = (dict(c_fwd), dict(c_bwd))
        if x.requires_grad:
            # the gradient of row i of x: every weight that row was multiplied by, on any rank
            ws = [torch.randn(sum(len(sends[s][d]) for s in range(world)), 3,
                              generator=torch.Generator().manual_seed(7 + d), dtype=torch.float64)
                  for d in range(world)]
            want_g = torch.zeros_like(x)
            for d in range(world):
                start = sum(len(sends[s][d]) for s in range(rank))
                for k, i in enumerate(sends[rank][d].tolist()):
                    want_g[i] += ws[d][start + k]
            errs[f"bwd {seed}"] = float((x.grad - want_g).abs().max()) if x.numel() else 0.0
    try:
        route_rows(torch.zeros(1, 3), [torch.zeros(0, dtype=torch.long)], [0], group=group)
        errs["wrong plan length"] = "no error"
    except ValueError as e:
        errs["wrong plan length"] = str(e)
    return errs, calls


@pytest.mark.parametrize("world", [2, 3])
def test_route_rows_matches_the_whole_routing(world):
    for rank, (errs, calls) in enumerate(run_distributed(_worker, world)):
        bad = {k: v for k, v in errs.items() if isinstance(v, float) and v > 1e-15}
        assert not bad, (rank, bad)
        assert "one send index and one receive count per rank" in errs["wrong plan length"]
        for fwd, bwd in calls.values():  # one exchange each way, whatever the counts
            assert fwd == {"all_to_all_single": 1} and bwd == {"all_to_all_single": 1}, (fwd, bwd)
