"""Collectives with autograd on real gloo processes: values and gradients against what the same
operation on the whole (unsharded) tensor gives, with uneven sizes, B = 1 and B > 1, fused tensors
of different shapes; the fence that makes a failure on one rank an error on every rank, and the
failure flags that ride the all-to-all so that the fence costs nothing when no rank failed."""

import pytest
import torch
import torch.distributed as dist

from seqpar.comm.agree import fence
from seqpar.comm.collectives import all_to_all, all_to_all_multi, even_ranges, split_sizes
from seqpar.comm.counting import count_collectives
from seqpar.comm.gather import all_reduce_sum, gather_seq, reduce_scatter_seq, split_seq
from seqpar.comm.guard import Guard
from seqpar.comm.launch import run_distributed
from seqpar.comm.p2p import RingShift


def test_split_sizes_follow_tensor_split():
    for n in range(0, 23):
        for p in range(1, 6):
            want = [len(t) for t in torch.tensor_split(torch.arange(n), p)]
            assert split_sizes(n, p) == want
            assert [b for _, b in even_ranges(n, p)] == want


def _global(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _worker(rank, world):
    g = dist.group.WORLD
    errs = {}
    # seq -> head all-to-all on an uneven sequence (ranks hold different lengths) and uneven heads
    for s_total, heads, b in ((7, 5, 2), (1, 3, 2), (13, 8, 2), (4, 1, 2), (7, 5, 1), (13, 8, 1)):
        x_full = _global(s_total * 10 + heads, b, s_total, heads, 3)
        w = _global(1, b, s_total, heads, 3)
        seq = split_sizes(s_total, world)
        off = sum(seq[:rank])
        x = x_full[:, off:off + seq[rank]].clone().requires_grad_(True)
        y = all_to_all(x, scatter_dim=2, gather_dim=1, group=g, gather_sizes=seq)  # [B, S, H/P, D]
        h0, hn = even_ranges(heads, world)[rank]
        errs[f"a2a fwd S={s_total} H={heads} B={b}"] = \
            float((y - x_full[:, :, h0:h0 + hn]).abs().max()) if y.numel() else 0.0
        # loss = sum(w * x) over the whole tensor, computed piecewise on the head shards
        (y * w[:, :, h0:h0 + hn]).sum().backward()
        errs[f"a2a bwd S={s_total} H={heads} B={b}"] = float((x.grad - w[:, off:off + seq[rank]]).abs().max()) \
            if x.numel() else 0.0
        # and back: head -> seq is the inverse
        z = all_to_all(y.detach(), scatter_dim=1, gather_dim=2, group=g,
                       gather_sizes=[n for _, n in even_ranges(heads, world)])
        errs[f"a2a inverse S={s_total} H={heads} B={b}"] = float((z - x.detach()).abs().max()) if z.numel() else 0.0

    # overlapping ranges (replication): every rank receives all of x's dim 0; grads sum over copies
    x = _global(7, 3, 2).requires_grad_(True) if rank == 0 else _global(8, 3, 2).requires_grad_(True)
    (y,) = all_to_all_multi([x], scatter_dim=0, gather_dim=1, group=g,
                            send_ranges=[[(0, 3)] * world], recv_sizes=[[2] * world])
    y.sum().backward()
    errs["replicated grad"] = float((x.grad - world).abs().max())

    # fused: q, k, v of different head counts (one message block, or one after another where the
    # head dims differ too) equal separate calls, forward and backward; outputs may be modified in place
    for b, dv in ((2, 4), (1, 4), (1, 3)):
        q, k = _global(3, b, 5, 6, 4).requires_grad_(True), _global(4, b, 5, 2, 4).requires_grad_(True)
        v = _global(5, b, 5, 2, dv).requires_grad_(True)
        rq, rk = even_ranges(6, world), even_ranges(2, world)
        fq, fk, fv = all_to_all_multi([q, k, v], scatter_dim=2, gather_dim=1, group=g, send_ranges=[rq, rk, rk],
                                      recv_sizes=[[5] * world] * 3)
        alone = [all_to_all_multi([x], scatter_dim=2, gather_dim=1, group=g, send_ranges=[r],
                                  recv_sizes=[[5] * world])[0] for x, r in ((q, rq), (k, rk), (v, rk))]
        errs[f"fused fwd B={b} Dv={dv}"] = max(float((f - a).abs().max()) if f.numel() else 0.0
                                               for f, a in zip((fq, fk, fv), alone, strict=True))
        fk.mul_(3)
        (fq.sum() * 2 + fk.sum() + fv.sum() * 4).backward()
        errs[f"fused grad q B={b} Dv={dv}"] = float((q.grad - 2).abs().max())
        errs[f"fused grad k B={b} Dv={dv}"] = float((k.grad - 3).abs().max())
        errs[f"fused grad v B={b} Dv={dv}"] = float((v.grad - 4).abs().max())

    # gather_seq (sum backward) and split_seq (gather backward), uneven
    for s_total in (5, 1, 9):
        full = _global(11, 2, s_total, 3)
        seq = split_sizes(s_total, world)
        off = sum(seq[:rank])
        x = full[:, off:off + seq[rank]].clone().requires_grad_(True)
        y = gather_seq(x, dim=1, group=g, sizes=seq)
        errs[f"gather fwd S={s_total}"] = float((y - full).abs().max())
        (y * (rank + 1)).sum().backward()  # every rank uses the whole tensor, with its own weight
        errs[f"gather bwd S={s_total}"] = float((x.grad - world * (world + 1) / 2).abs().max()) if x.numel() else 0.0
        whole = full.clone().requires_grad_(True)
        part = split_seq(whole, dim=1, group=g)
        errs[f"split fwd S={s_total}"] = float((part - full[:, off:off + seq[rank]]).abs().max()) \
            if part.numel() else 0.0
        (part * 5).sum().backward()
        errs[f"split bwd S={s_total}"] = float((whole.grad - 5).abs().max())

    # reduce_scatter_seq (gather backward) and all_reduce_sum (sum backward): per-rank partials of
    # a whole sequence, rank r's partial = (r + 1) * full, so the sum is P (P + 1) / 2 * full
    tri = world * (world + 1) / 2
    for s_total in (5, 1, 9):
        full = _global(13, 2, s_total, 3)
        seq = split_sizes(s_total, world)
        off = sum(seq[:rank])
        partial = (full * (rank + 1)).requires_grad_(True)
        mine = reduce_scatter_seq(partial, dim=1, group=g, sizes=seq)
        errs[f"reduce-scatter fwd S={s_total}"] = float((mine - tri * full[:, off:off + seq[rank]]).abs().max()) \
            if mine.numel() else 0.0
        (mine * (rank + 2)).sum().backward()  # rank r's shard weighted r + 2: every partial's gradient
        want = torch.cat([torch.full((2, n, 3), float(r + 2), dtype=full.dtype) for r, n in enumerate(seq)], dim=1)
        errs[f"reduce-scatter bwd S={s_total}"] = float((partial.grad - want).abs().max())
        partial = (full * (rank + 1)).requires_grad_(True)
        total = all_reduce_sum(partial, group=g)
        errs[f"all-reduce fwd S={s_total}"] = float((total - tri * full).abs().max())
        (total * (rank + 2)).sum().backward()  # each rank's use of the sum, weighted r + 2
        errs[f"all-reduce bwd S={s_total}"] = float((partial.grad - (tri + world)).abs().max())

    # ring shift: after P shifts every rank has its own tensor back, having seen all others
    shift = RingShift(g)
    t = torch.full((2,), float(rank))
    seen = []
    for _ in range(world):
        shift.start([t])
        (t,) = shift.wait()
        seen.append(int(t[0]))
    errs["ring order"] = 0.0 if seen == [(rank - i - 1) % world for i in range(world)] else 1.0
    return {"errs": errs, "fence": _fences(rank, world), "flags": _flags(rank, world)}


class _Recorder:
    """A Flag that sends ``10 + rank`` in the exchange of ``direction`` and keeps what it hears."""

    def __init__(self, rank, direction):
        self.rank, self.direction, self.heard = rank, direction, None

    def value(self):
        return 10.0 + self.rank

    def receive(self, values):
        self.heard = values


def _flags(rank, world):
    """What a flag heard through each direction of an all-to-all (and that the values still moved
    right), and the collectives of a guarded call whose failure flags ride its all-to-alls: when
    nothing fails, when the last rank fails in the forward, when it fails in the backward."""
    g = dist.group.WORLD
    heads = even_ranges(5, world)

    def to_seq(x, flag):  # [B, S/P, 5, 3] -> [B, S, 5/P, 3]
        return all_to_all_multi([x], scatter_dim=2, gather_dim=1, group=g, send_ranges=[heads],
                                recv_sizes=[[4] * world], flag=flag)[0]

    def to_heads(y, flag):  # [B, S, 5/P, 3] -> [B, S/P, 5, 3]
        return all_to_all_multi([y], scatter_dim=1, gather_dim=2, group=g, send_ranges=[even_ranges(4 * world, world)],
                                recv_sizes=[[n for _, n in heads]], flag=flag)[0]

    seen = {}
    for direction in ("forward", "backward"):
        x = _global(9, 2, 4, 5, 3).requires_grad_(True)  # the same on every rank
        flag = _Recorder(rank, direction)
        y = to_seq(x, flag)
        y.sum().backward()
        h0, hn = heads[rank]
        moved = torch.equal(y, torch.cat([x.detach()[:, :, h0:h0 + hn]] * world, 1)) and bool((x.grad == 1).all())
        seen[f"heard {direction}"] = (flag.heard, moved)
    for when in ("none", "forward", "backward"):
        guard = Guard([g], "test call")
        (x,) = guard.inputs(_global(9, 1, 4, 5, 3).requires_grad_(True))
        failing = rank == world - 1
        caught = []
        with count_collectives() as calls:
            try:
                y = to_seq(x, guard.flag("backward"))
                if failing and when == "forward":
                    guard.call(_raise, "kernel failed")
                if failing and when == "backward":
                    y = _FailInBackward.apply(y, guard)
                z = to_heads(y, guard.flag("forward"))
                guard.fence("forward")
                z.sum().backward()
            except Exception as e:
                caught.append(f"{type(e).__name__}: {e}")
        seen[f"fails {when}"] = (caught, dict(calls))
    return seen


def _raise(text):
    raise _Boom(text)


class _FailInBackward(torch.autograd.Function):
    """Identity, whose backward fails under the guard (zeros go on)."""

    @staticmethod
    def forward(ctx, x, guard):
        ctx.guard = guard
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.guard.call(_raise, "backward failed")
        return torch.zeros_like(grad), None


class _Boom(RuntimeError):
    pass


class _Picky(Exception):
    def __init__(self, code, text):  # cannot be rebuilt from a message alone
        super().__init__(f"{code}: {text}")


def _fences(rank, world):
    """What ``fence`` raised on this rank for: nothing failed; the last rank failed (its own type);
    rank 0 failed with a ValueError; ranks 0 and 2 failed; a type that cannot be rebuilt; a 2 x 2 grid
    fenced in stages (ulysses groups, then rings) with the last rank failing."""
    g = dist.group.WORLD
    last = world - 1
    cases = {"none": (g, None), "last": (g, _Boom("out of memory") if rank == last else None),
             "value": (g, ValueError("bad shape") if rank == 0 else None),
             "two": (g, RuntimeError(f"failed {rank}") if rank in (0, 2) else None),
             "picky": (g, _Picky(7, "odd") if rank == last else None)}
    if world == 4:
        rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        cases["grid"] = ([rows[rank // 2], cols[rank % 2]], _Boom("grid") if rank == last else None)
    seen = {}
    for name, (groups, error) in cases.items():
        try:
            fence(groups, error, what="test call")
            seen[name] = None
        except Exception as e:
            seen[name] = (type(e).__name__, str(e), e.__cause__ is error and error is not None)
    return seen


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda p: f"P{p}")
def results(request):
    return request.param, run_distributed(_worker, request.param, timeout=300)


@pytest.mark.distributed
def test_fence_raises_on_every_rank(results):
    p, per_rank = results
    seen = [r["fence"] for r in per_rank]
    last = p - 1
    for rank, s in enumerate(seen):
        assert s["none"] is None
        mine = rank == last
        assert s["last"] == ("_Boom" if mine else "RuntimeError", seen[0]["last"][1], mine)
        assert f"rank {last}: _Boom: out of memory" in s["last"][1] and "test call" in s["last"][1]
        assert s["value"] == ("ValueError", seen[0]["value"][1], rank == 0)  # bad input stays a ValueError
        if p >= 3:
            assert "rank 0: RuntimeError: failed 0" in s["two"][1] and "rank 2: RuntimeError: failed 2" in s["two"][1]
        assert s["picky"] == ("RuntimeError", seen[0]["picky"][1], mine)  # chained, even if not rebuilt
        assert f"rank {last}: _Picky: 7: odd" in s["picky"][1]
        if p == 4:  # staged: the failure in one ulysses group reaches every rank of the grid
            assert s["grid"] == ("_Boom" if mine else "RuntimeError", seen[0]["grid"][1], mine)
            assert "rank 3: _Boom: grid" in s["grid"][1]


@pytest.mark.distributed
def test_flags_ride_the_all_to_all(results):
    p, per_rank = results
    for rank, seen in enumerate(r["flags"] for r in per_rank):
        for direction in ("forward", "backward"):
            assert seen[f"heard {direction}"] == ([10.0 + r for r in range(p)], True), (direction, rank)
        # nothing failed: the fences cost no collective of their own (an exchange is one batch of
        # point-to-point transfers; a single rank keeps everything)
        assert seen["fails none"] == ([], {"batch_isend_irecv": 4} if p > 1 else {}), rank
        for when in ("forward", "backward"):  # the flag said so: one fence, raised on every rank
            caught, calls = seen[f"fails {when}"]
            assert len(caught) == 1 and f"test call ({when}) failed" in caught[0], (when, rank, caught)
            assert f"rank {p - 1}: _Boom: {when if when == 'backward' else 'kernel'} failed" in caught[0]
            assert caught[0].startswith("_Boom" if rank == p - 1 else "RuntimeError"), (when, rank, caught)
            assert calls.get("all_gather_flat", 0) == (2 if p > 1 else 0)  # the verdicts, then the texts
            assert calls.get("batch_isend_irecv", 0) == (0 if p == 1 else 2 if when == "forward" else 4)


@pytest.mark.distributed
def test_collectives_exact(results):
    p, per_rank = results
    for rank, errs in enumerate(r["errs"] for r in per_rank):
        bad = {k: v for k, v in errs.items() if v > 1e-12}
        assert not bad, f"P={p} rank {rank}: {bad}"
