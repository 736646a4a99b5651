"""The number of collectives per Ulysses call is part of its contract: 2 all-to-all exchanges forward
(q, k, v fused in; out back), 2 backward, each one batch of point-to-point transfers, plus at most
one metadata all-gather (none when the caller passes a SeqShard and validate=False) and one for a
per-call padding mask. The failure guard (a kernel failure on one rank raises on every rank) costs
no collective of its own per call: checked per call, its flag rides the last exchange (no fence
unless a rank failed); with the batch's SeqShard it is checked once per batch -- one tiny
all-gather when the backward ends, however many calls the backward went through.

Copies are part of it too: each piece that travels in an exchange is copied at most once -- packed
on the sending side or unpacked on the receiving side, not both -- at B = 2 as at B = 1."""

import sys

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from seqpar.attention.ring import ring_attention
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
    out["copies"] = _exchange_copies(q, k, v, world)
    out["ring groups"] = _ring_hop_groups(q, k, v, world)
    alone, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)])  # a ring of this rank only
    out["alone"] = _alone_counts(q, k, v, alone)
    try:  # the world as its grad group: other ranks than the ring's
        ring_attention(q, k, v, group=alone, grad_group=dist.group.WORLD, causal=True)
        out["bad grad group"] = None
    except ValueError as e:
        out["bad grad group"] = str(e)
    return out


def _alone_counts(q, k, v, alone) -> dict[str, tuple[dict, dict, int, int]]:
    """Per strategy over a group of this rank alone (a dynamic schedule's degree-1 bin), checked per
    call and per batch: (forward collectives, backward collectives, exchanges, ring loops)."""
    import seqpar.attention.run as run
    import seqpar.comm.collectives as collectives

    runs = {"exchanges": 0, "rings": 0}
    orig_exchange, orig_ring = collectives._exchange, run.run_ring

    def exchange(*args, **kwargs):
        runs["exchanges"] += 1
        return orig_exchange(*args, **kwargs)

    def ring(*args, **kwargs):
        runs["rings"] += 1
        return orig_ring(*args, **kwargs)

    out = {}
    collectives._exchange, run.run_ring = exchange, ring
    try:
        for name, fn in (("ulysses", ulysses_attention), ("ring", ring_attention)):
            for how, kw in (("per call", {}), ("per batch", {"shard": SeqShard((5,)), "validate": False})):
                runs.update(exchanges=0, rings=0)
                with count_collectives() as fwd:
                    o = fn(q, k, v, group=alone, causal=True, **kw)
                with count_collectives() as bwd:
                    o.sum().backward()
                out[f"{name} {how}"] = (dict(fwd), dict(bwd), runs["exchanges"], runs["rings"])
    finally:
        collectives._exchange, run.run_ring = orig_exchange, orig_ring
    return out


def _ring_hop_groups(q, k, v, world: int) -> dict[str, list[str]]:
    """Which group each ring hop of a forward + backward ran on: the mesh's sp group or its grad group."""
    from seqpar.attention.dispatch import sp_attention
    from seqpar.comm.mesh import Axis, axis_group, grad_group, init_mesh

    mesh = init_mesh(sp=world, device_type="cpu")
    names = {id(axis_group(mesh, Axis.SP.value)): "sp", id(grad_group(mesh, Axis.SP.value)): "grad"}
    seen, orig = [], dist.batch_isend_irecv

    def recorded(ops):
        seen.append(names.get(id(ops[0].group), "other"))
        return orig(ops)

    dist.batch_isend_irecv = recorded
    try:
        o = sp_attention(q, k, v, mesh=mesh, strategy="ring", causal=True, shard=SeqShard((5,) * world),
                         validate=False)
        fwd, seen[:] = list(seen), []
        o.sum().backward()
    finally:
        dist.batch_isend_irecv = orig
    return {"forward": fwd, "backward": list(seen)}


def _exchange_copies(q, k, v, world: int) -> list[tuple[int, int, int]]:
    """Per exchange of one forward + backward: (pieces that travel, packing copies, landing copies)."""
    import seqpar.comm.collectives as collectives

    exchanges, orig = [], collectives._exchange
    copy_, contiguous = Tensor.copy_, Tensor.contiguous

    def in_exchange() -> bool:
        return sys._getframe(2).f_code.co_name == "_exchange"

    def counted_copy(self, *args, **kwargs):
        if in_exchange():
            exchanges[-1][2] += 1
        return copy_(self, *args, **kwargs)

    def counted_contiguous(self, *args, **kwargs):
        if in_exchange() and not self.is_contiguous():
            exchanges[-1][1] += 1
        return contiguous(self, *args, **kwargs)

    def exchange(sends, recvs, group, flag=None, *, by_row=False):
        rows = (lambda t: t.shape[0]) if by_row else (lambda t: 1)
        me = dist.get_rank(group)
        exchanges.append([sum(rows(t) for r, ts in enumerate(sends) if r != me for t in ts if t.numel()), 0,
                          -sum(rows(t) for t in sends[me])])  # the rank's own pieces: one copy each, no travel
        return orig(sends, recvs, group, flag, by_row=by_row)

    collectives._exchange, Tensor.copy_, Tensor.contiguous = exchange, counted_copy, counted_contiguous
    try:
        o = ulysses_attention(q, k, v, group=dist.group.WORLD, causal=True, shard=SeqShard((5,) * world),
                              validate=False)
        o.sum().backward()
    finally:
        collectives._exchange, Tensor.copy_, Tensor.contiguous = orig, copy_, contiguous
    return [tuple(e) for e in exchanges]


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


def test_a_group_of_one_rank_runs_no_collective(counts):
    """A dynamic schedule's degree-1 bin: Ulysses and ring over this rank alone attend locally, with
    no collective, no exchange (its copies) and no ring loop, forward or backward, checked per call
    or per batch (exactness: the P1 cases of test_ulysses and test_ring)."""
    for per_rank in counts:
        assert per_rank["alone"] == {f"{name} {how}": ({}, {}, 0, 0) for name in ("ulysses", "ring")
                                     for how in ("per call", "per batch")}, per_rank["alone"]


def test_each_travelling_piece_is_copied_once(counts):
    """B = 2: the pieces that leave or reach a rank are copied at most once (a whole KV head set
    that a rank replicates is not copied at all); before rows travelled apart, q, k, v were packed
    and then landed: two copies each."""
    for per_rank in counts:
        assert len(per_rank["copies"]) == 4  # q, k, v in; out back; and their backward
        for travelling, packed, landed in per_rank["copies"]:
            assert travelling > 0 and packed + landed <= travelling, per_rank["copies"]


def test_ring_grads_travel_on_their_own_group(counts):
    """K/V hops on the sp group, the backward's dK/dV hops on the mesh's second group over the same
    ranks (its own NCCL stream on GPUs: never queued behind the next K/V block)."""
    for per_rank in counts:
        p = len(counts)
        groups = per_rank["ring groups"]
        assert groups["forward"] == ["sp"] * (p - 1)
        assert sorted(groups["backward"]) == sorted(["sp"] * (p - 1) + ["grad"] * p), groups["backward"]


def test_a_grad_group_over_other_ranks_is_refused_on_every_rank(counts):
    """grad_group must hold the ring's ranks (in its order): a clear ValueError, before any collective."""
    for per_rank in counts:
        said = per_rank["bad grad group"]
        assert said is not None and "grad_group holds ranks" in said and "omit grad_group" in said, said
