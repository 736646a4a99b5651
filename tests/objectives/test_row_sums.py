"""Per-sequence sums of float32 values do not depend on P: each is the float64 sum of its tokens,
rounded once (a token-by-token float32 sum of a 16k-token row's log-probs gave a DPO loss of 3.766
at sp=1 against 3.607 at sp=4 from the same weights)."""

import pytest
import torch
import torch.distributed as dist

from seqpar.comm.launch import run_distributed
from seqpar.objectives.rows import Sequences, row_sums

LENGTH = 16381  # odd: the shards are uneven
DOCS = (9000, 5000, LENGTH - 14000)  # one packed row of three documents


def _row() -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [1, L] float32, ids [1, L])``: log-prob-like values of a few nats each."""
    g = torch.Generator().manual_seed(0)
    values = -torch.rand(1, LENGTH, generator=g, dtype=torch.float64).mul(12.0).float()
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCS)])[None]
    return values, ids


def _want(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The float64 per-document sums, rounded to float32 once."""
    return torch.zeros(len(DOCS), dtype=torch.float64).index_add(0, ids[0], values[0].double()).float()


def _shard_sums(rank: int, world: int) -> dict:
    values, ids = _row()
    bounds = [LENGTH * r // world for r in range(world + 1)]
    local = values[:, bounds[rank]:bounds[rank + 1]].clone().requires_grad_()
    local_ids = ids[:, bounds[rank]:bounds[rank + 1]]
    seqs = Sequences(local_ids, torch.zeros_like(local_ids, dtype=torch.bool), len(DOCS))
    group = dist.group.WORLD if world > 1 else None
    sums = row_sums(local, seqs, group)  # [3]
    sums.sum().backward()
    return {"sums": sums.detach(), "dtype": sums.dtype, "grad": local.grad, "grad_dtype": local.grad.dtype}


def test_float32_row_sums_are_the_float64_sums_rounded_once():
    values, ids = _row()
    got = _shard_sums(0, 1)
    want = _want(values, ids)
    assert got["dtype"] == torch.float32 and got["grad_dtype"] == torch.float32
    assert torch.equal(got["sums"], want), (got["sums"], want)
    assert torch.equal(got["grad"], torch.ones_like(values))
    naive = torch.zeros(len(DOCS)).index_add(0, ids[0], values[0])  # float32, token by token
    assert not torch.equal(naive, want)  # the case is one where float32 accumulation shows


@pytest.mark.distributed
@pytest.mark.parametrize("world", [3])
def test_float32_row_sums_are_the_same_at_every_p(world):
    values, ids = _row()
    want = _want(values, ids)
    for rank, got in enumerate(run_distributed(_shard_sums, world, timeout=120)):
        assert torch.equal(got["sums"], want), (rank, got["sums"], want)
        # every rank's share pre-scaled by P for the average over SP ranks (rows.py's convention)
        assert torch.equal(got["grad"], torch.full_like(got["grad"], float(world)))
