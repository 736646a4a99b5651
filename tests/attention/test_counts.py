"""The number of collectives per Ulysses call is part of its contract: 2 all-to-all exchanges forward
(q, k, v fused in; out back), 2 backward, each one batch of point-to-point transfers, plus at most
one metadata all-gather (none when the caller passes a SeqShard and validate=False) and one for a
per-call padding mask. The failure guard (a kernel failure on one rank raises on every rank) costs
no collective of its own per call: checked per call, its flag rides the last exchange (no fence
unless a rank failed); with the batch's SeqShard it is checked once per batch -- one tiny
all-gather when the backward ends, however many calls the backward went through."""

import pytest
import torch
import torch.distributed as dist

from seqpar.attention.shard import SeqShard
from seqpar.attention.ulysses import ulysses_attention
from seqpar.comm.counting import count_collectives
from seqpar.comm.launch import run_distributed

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes


def _worker(rank, world):
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(2, 5, 8, 4, generator=g, requires_grad=True)
    k = torch.randn(2, 5, 2, 4, generator=g, requires_grad=True)
    v = torch.randn(2, 5, 2, 4, generator=g, requires_grad=True)
    mask = torch.ones(2, 5, dtype=torch.bool)
    out = {}
    for name, kw in (("validated", {}),
                     ("trusted", {"shard": SeqShard((5,) * world), "validate": False}),
                     ("trusted x3", {"shard": SeqShard((5,) * world), "validate": False}),
                     ("local mask", {"key_padding_mask": mask})):
        with count_collectives() as fwd:
            o = ulysses_attention(q, k, v, group=dist.group.WORLD, causal=True, **kw)
            if name == "trusted x3":  # three layers of one batch
                for _ in range(2):
                    o = ulysses_attention(o, k, v, group=dist.group.WORLD, causal=True, **kw)
        with count_collectives() as bwd:
            o.sum().backward()
        out[name] = (dict(fwd), dict(bwd))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"P{p}")
def counts(request):
    return run_distributed(_worker, request.param, timeout=120)


def test_ulysses_collective_counts(counts):
    for per_rank in counts:
        fwd, bwd = per_rank["validated"]
        assert fwd == {"batch_isend_irecv": 2, "all_gather_flat": 1}
        assert bwd == {"batch_isend_irecv": 2}
        fwd, bwd = per_rank["trusted"]
        assert fwd == {"batch_isend_irecv": 2}
        assert bwd == {"batch_isend_irecv": 2, "all_gather_flat": 1}  # the batch's failure check
        fwd, bwd = per_rank["trusted x3"]
        assert fwd == {"batch_isend_irecv": 6}
        assert bwd == {"batch_isend_irecv": 6, "all_gather_flat": 1}
        fwd, bwd = per_rank["local mask"]
        assert fwd == {"batch_isend_irecv": 2, "all_gather_flat": 2}
        assert bwd == {"batch_isend_irecv": 2}
