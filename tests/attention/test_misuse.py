"""Bad input raises the same clear ValueError on every rank -- never a hang -- and the group stays
usable afterwards; so does a kernel that raises on one rank only, in the forward or the backward."""

import pytest
import torch
import torch.distributed as dist

from seqpar.attention.shard import SeqShard
from seqpar.attention.ulysses import ulysses_attention
from seqpar.comm.launch import WorkerError, run_distributed
from seqpar.testing.attention_faults import crash_problems, crash_scenarios, run_crashes

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes


def _inputs(rank, b=2, s=5, h=4, hk=2, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(rank)
    return (torch.randn(b, s, h, d, generator=g, dtype=dtype), torch.randn(b, s, hk, d, generator=g, dtype=dtype),
            torch.randn(b, s, hk, d, generator=g, dtype=dtype))


def _case(name, rank):
    """(kwargs for ulysses_attention, q, k, v) for a misuse case as seen by ``rank``."""
    q, k, v = _inputs(rank)
    kw = {}
    if name == "dtype on one rank" and rank == 1:
        q, k, v = (t.float() for t in (q, k, v))
    elif name == "heads differ" and rank == 0:
        q, k, v = _inputs(rank, h=8)
    elif name == "heads not multiple of kv heads" and rank == 1:
        q, k, v = _inputs(rank, h=3, hk=2)
    elif name == "mask shape" and rank == 1:
        kw["key_padding_mask"] = torch.ones(2, 4, dtype=torch.bool)
    elif name == "mask on one rank only" and rank == 0:
        kw["key_padding_mask"] = torch.ones(2, 5, dtype=torch.bool)
    elif name == "mask on one rank only":
        pass
    elif name == "causal differs":
        kw["causal"] = rank == 0
    elif name == "softcap with sdpa":
        kw.update(softcap=5.0, kernel="sdpa")  # sdpa cannot honour softcap
    elif name == "shard length":  # rank 0 was handed a SeqShard of another batch
        lens = [5] * dist.get_world_size()
        if rank == 0:
            lens[0] = 6
        kw["shard"] = SeqShard(tuple(lens))
    elif name == "seq mismatch q vs k" and rank == 1:
        k = k[:, :3]
    elif name == "3-D input" and rank == 0:
        q = q[0]
    return kw, q, k, v


EXPECT = {
    "dtype on one rank": "dtype of q differs across ranks",
    "heads differ": "number of query heads differs across ranks",
    "heads not multiple of kv heads": "rank 1: 3 query heads are not a multiple of 2 KV heads",
    "mask shape": "rank 1: key_padding_mask must be [batch, local_seq_len] = [2, 5]",
    "mask on one rank only": "whether a key padding mask is given differs across ranks",
    "causal differs": "causal differs across ranks",
    "softcap with sdpa": "cannot honour ['softcap']",
    "shard length": "rank 0: the SeqShard says this rank holds 6 tokens but q holds 5",
    "seq mismatch q vs k": "rank 1: q, k, v must share batch and local_seq_len",
    "3-D input": "rank 0: q must be 4-D",
}


def _worker(rank, world):
    seen = {}
    for name in EXPECT:
        kw, q, k, v = _case(name, rank)
        try:
            ulysses_attention(q, k, v, group=dist.group.WORLD, **{"kernel": "reference", **kw})
            seen[name] = "no error"
        except ValueError as e:
            seen[name] = str(e)
        # the group still works: a good call right after the bad one
        q, k, v = _inputs(rank)
        out = ulysses_attention(q, k, v, group=dist.group.WORLD, kernel="reference")
        assert out.shape == q.shape
    return {"misuse": seen, "crash": run_crashes(rank, world)}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"P{p}")
def seen(request):
    # a short process-group timeout: a rank left waiting in a collective fails fast, not in 60 s
    return request.param, run_distributed(_worker, request.param, timeout=120, pg_timeout=15)


@pytest.mark.parametrize("name", list(EXPECT))
def test_every_rank_gets_the_message(seen, name):
    p, per_rank = seen
    for rank in range(p):
        msg = per_rank[rank]["misuse"][name]
        assert EXPECT[name] in msg, f"rank {rank}: {msg}"


def test_kernel_failure_on_one_rank_raises_on_every_rank(seen):
    p, per_rank = seen  # ulysses (lse and plain local kernels), ring, hybrid; forward and backward
    problems = {c.label(): crash_problems(c, [r["crash"][c.label()] for r in per_rank]) for c in crash_scenarios(p)}
    assert not any(problems.values()), {k: v for k, v in problems.items() if v}


def _hangs(rank, world):
    if rank == 0:
        return "done"  # rank 1 waits in a collective rank 0 never joins
    dist.all_reduce(torch.ones(1))


def _raises(rank, world):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    dist.all_reduce(torch.ones(1))


def test_hang_becomes_an_error_with_the_stack():
    with pytest.raises(WorkerError) as info:
        run_distributed(_hangs, 2, timeout=8, pg_timeout=30)
    assert 1 in info.value.errors
    assert "all_reduce" in info.value.errors[1].text or "hung" in info.value.errors[1].text


def test_a_raising_rank_is_reported():
    with pytest.raises(WorkerError) as info:
        run_distributed(_raises, 2, timeout=30, pg_timeout=10)
    assert "boom on rank 1" in info.value.errors[1].text
