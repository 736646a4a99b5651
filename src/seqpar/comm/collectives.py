"""The all-to-all with autograd, and the size conventions every collective of seqpar shares.

Uneven sizes are normal: a dim of size n split over P ranks follows ``torch.tensor_split`` (the
first ``n % P`` ranks hold one more), see :func:`split_sizes`. Everything is built on
``all_to_all_single`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` /
``batch_isend_irecv``, which behave the same on gloo and NCCL: the code the CPU tests run is the code
that runs on GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

Group = dist.ProcessGroup

# torch 2.13 renamed these (the old names warn); keep both working.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: Tensor, input: Tensor, *, group: Group | None = None) -> None:
    """``output [P * n, ...]`` = every rank's ``input [n, ...]`` in rank order (equal sizes).
    Callers reach it as ``collectives.all_gather_flat`` so :func:`count_collectives` sees it."""
    _ALL_GATHER(output, input, group=group)


def reduce_scatter_flat(output: Tensor, input: Tensor, *, group: Group | None = None) -> None:
    """``output [n, ...]`` = the sum over ranks of slot ``rank`` of ``input [P * n, ...]``."""
    _REDUCE_SCATTER(output, input, group=group)


def comm_device(group: Group) -> torch.device:
    """The device a collective of ``group`` needs its tensors on: CUDA for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``torch.tensor_split(range(n), parts)``: the first ``n % parts`` get one more."""
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def split_offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each part: ``[0, s0, s0 + s1, ...]`` (length ``len(sizes)``)."""
    offsets, acc = [], 0
    for s in sizes:
        offsets.append(acc)
        acc += s
    return offsets


def even_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each part of :func:`split_sizes`."""
    sizes = split_sizes(n, parts)
    return list(zip(split_offsets(sizes), sizes, strict=True))


# --------------------------------------------------------------------------------------------
# all-to-all
# --------------------------------------------------------------------------------------------

def _exchange(sends: list[list[Tensor]], recv_shapes: list[list[torch.Size]], group: Group) -> list[list[Tensor]]:
    """One ``all_to_all_single``: ``sends[r]`` goes to rank r, ``recv_shapes[s]`` come from rank s.

    Each list holds one tensor per fused input; all are flattened into one buffer, so fusing q, k
    and v costs one collective, not three.
    """
    ref = next(t for per_rank in sends for t in per_rank)
    dtype, device = ref.dtype, ref.device
    in_splits = [sum(t.numel() for t in per_rank) for per_rank in sends]
    out_splits = [sum(int(torch.Size(s).numel()) for s in shapes) for shapes in recv_shapes]
    # Pieces are strided views (a head slice of [B, S, H, D]): copy each straight into its place in
    # the send buffer -- one copy, not a .contiguous() and then a cat.
    send_buf = torch.empty(sum(in_splits), dtype=dtype, device=device)
    pos = 0
    for per_rank in sends:
        for t in per_rank:
            send_buf[pos:pos + t.numel()].view(t.shape).copy_(t)
            pos += t.numel()
    recv_buf = torch.empty(sum(out_splits), dtype=dtype, device=device)
    dist.all_to_all_single(recv_buf, send_buf, out_splits, in_splits, group=group)
    out, pos = [], 0
    for shapes in recv_shapes:
        per_rank = []
        for s in shapes:
            n = int(torch.Size(s).numel())
            per_rank.append(recv_buf[pos:pos + n].view(s))
            pos += n
        out.append(per_rank)
    return out


class _AllToAll(torch.autograd.Function):
    """Forward: rank r sends ``x.narrow(scatter_dim, *send_ranges[r])`` to every rank and
    concatenates what it receives along ``gather_dim``. Backward: the same exchange reversed --
    each gradient slice goes back to the rank it came from and is added into the range it was cut
    from. Ranges may overlap (a KV head replicated to several ranks); adding them sums the
    gradients of the copies, which is exactly the gradient of a replication.

    Several tensors with the same dtype move in one collective (fused q, k, v).
    """

    @staticmethod
    def forward(ctx, group, scatter_dim, gather_dim, send_ranges, recv_sizes, *xs):
        p, me = dist.get_world_size(group), dist.get_rank(group)
        sends = [[x.narrow(scatter_dim, *rngs[r]) for x, rngs in zip(xs, send_ranges, strict=True)]
                 for r in range(p)]
        recv_shapes = []
        for s in range(p):
            shapes = []
            for x, rngs, sizes in zip(xs, send_ranges, recv_sizes, strict=True):
                shape = list(x.shape)
                shape[scatter_dim] = rngs[me][1]
                shape[gather_dim] = sizes[s]
                shapes.append(torch.Size(shape))
            recv_shapes.append(shapes)
        received = _exchange(sends, recv_shapes, group)
        outs = [torch.cat([received[s][i] for s in range(p)], dim=gather_dim) for i in range(len(xs))]
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        ctx.send_ranges, ctx.recv_sizes = send_ranges, recv_sizes
        ctx.in_shapes = [x.shape for x in xs]
        ctx.out_shapes = [o.shape for o in outs]
        ctx.dtype, ctx.device = xs[0].dtype, xs[0].device
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        group, sd, gd = ctx.group, ctx.scatter_dim, ctx.gather_dim
        p = dist.get_world_size(group)
        # An output that took no part in the loss has no gradient: it still must be exchanged.
        grads = [g if g is not None else torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
                 for g, shape in zip(grads, ctx.out_shapes, strict=True)]
        # Slice the gradient by the rank each piece of the output came from ...
        sends = [[g.narrow(gd, sum(sizes[:s]), sizes[s]) for g, sizes in zip(grads, ctx.recv_sizes, strict=True)]
                 for s in range(p)]
        # ... and receive, from every rank r, the gradient of the slice we sent it.
        recv_shapes = []
        for r in range(p):
            shapes = []
            for shape, rngs in zip(ctx.in_shapes, ctx.send_ranges, strict=True):
                s_ = list(shape)
                s_[sd] = rngs[r][1]
                shapes.append(torch.Size(s_))
            recv_shapes.append(shapes)
        received = _exchange(sends, recv_shapes, group)
        dxs = []
        for i, (shape, rngs) in enumerate(zip(ctx.in_shapes, ctx.send_ranges, strict=True)):
            pieces = [received[r][i] for r in range(p)]
            if _is_partition(rngs, shape[sd]):  # the usual case: one copy, no zero-fill
                dxs.append(torch.cat([pieces[r] for r in sorted(range(p), key=lambda r: rngs[r][0])], dim=sd))
                continue
            dx = torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
            for r in range(p):
                dx.narrow(sd, *rngs[r]).add_(pieces[r])
            dxs.append(dx)
        return (None, None, None, None, None, *dxs)


def _is_partition(ranges: Sequence[tuple[int, int]], n: int) -> bool:
    """Do the ranges tile ``[0, n)`` exactly once (no replication, nothing left out)?"""
    pos = 0
    for start, length in sorted(r for r in ranges if r[1]):
        if start != pos:
            return False
        pos += length
    return pos == n


def all_to_all_multi(xs: Sequence[Tensor], *, scatter_dim: int, gather_dim: int, group: Group,
                     send_ranges: Sequence[Sequence[tuple[int, int]]],
                     recv_sizes: Sequence[Sequence[int]]) -> tuple[Tensor, ...]:
    """Fused all-to-all of several tensors in one collective, with autograd.

    ``send_ranges[i][r] = (start, length)``: the slice of ``xs[i]`` along ``scatter_dim`` that goes
    to rank r (ranges may overlap: replication). ``recv_sizes[i][s]``: the size along
    ``gather_dim`` of what rank s sends for ``xs[i]``. Outputs are concatenated along
    ``gather_dim`` in rank order. All tensors must share a dtype.
    """
    if len({x.dtype for x in xs}) != 1:
        raise ValueError(f"fused all-to-all needs one dtype, got {[x.dtype for x in xs]}")
    nd = xs[0].dim()
    sd, gd = scatter_dim % nd, gather_dim % nd
    if sd == gd:
        raise ValueError(f"scatter_dim and gather_dim must differ, both are {sd}")
    send_ranges = tuple(tuple((int(a), int(b)) for a, b in rngs) for rngs in send_ranges)
    recv_sizes = tuple(tuple(int(s) for s in sizes) for sizes in recv_sizes)
    return _AllToAll.apply(group, sd, gd, send_ranges, recv_sizes, *xs)


def all_to_all(x: Tensor, *, scatter_dim: int, gather_dim: int, group: Group,
               gather_sizes: Sequence[int] | None = None) -> Tensor:
    """Scatter ``x`` along ``scatter_dim`` (tensor_split convention) and gather along ``gather_dim``.

    ``gather_sizes[s]``: the size along ``gather_dim`` held by rank s; None means every rank holds
    the same as this one. Backward is the reverse all-to-all. Example (Ulysses)::

        x    # [B, S/P, H, D]  (this rank's sequence shard, all heads)
        y = all_to_all(x, scatter_dim=2, gather_dim=1, group=g, gather_sizes=seq_lens)
        y    # [B, S, H/P, D]  (the whole sequence, this rank's heads)
    """
    p = dist.get_world_size(group)
    nd = x.dim()
    sizes = list(gather_sizes) if gather_sizes is not None else [x.shape[gather_dim % nd]] * p
    if len(sizes) != p:
        raise ValueError(f"gather_sizes has {len(sizes)} entries for a group of {p} ranks")
    if sizes[dist.get_rank(group)] != x.shape[gather_dim % nd]:
        raise ValueError(f"gather_sizes[{dist.get_rank(group)}]={sizes[dist.get_rank(group)]} but this rank holds"
                         f" {x.shape[gather_dim % nd]} along dim {gather_dim}")
    ranges = even_ranges(x.shape[scatter_dim % nd], p)
    return all_to_all_multi([x], scatter_dim=scatter_dim, gather_dim=gather_dim, group=group,
                            send_ranges=[ranges], recv_sizes=[sizes])[0]
