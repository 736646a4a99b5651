"""The all-to-all with autograd, and the size conventions every collective of seqpar shares.

Uneven sizes are normal: a dim of size n split over P ranks follows ``torch.tensor_split`` (the
first ``n % P`` ranks hold one more), see :func:`split_sizes`. Everything is built on
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``batch_isend_irecv`` (the all-to-all too:
it moves every piece straight between its places, see :func:`_exchange`), which behave the same on
gloo and NCCL: the code the CPU tests run is the code that runs on GPUs. Inside ``torch.compile``
the all-to-all is torch's functional one (:func:`_traced_all_to_all`), which dynamo traces into the
graph with its autograd: no graph break.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

from . import waits
from .mesh import uses_nccl

Group = dist.ProcessGroup

# torch 2.13 renamed these (the old names warn); keep both working.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: Tensor, input: Tensor, *, group: Group | None = None) -> None:
    """``output [P * n, ...]`` = every rank's ``input [n, ...]`` in rank order (equal sizes).
    Callers reach it as ``collectives.all_gather_flat`` so :func:`count_collectives` sees it.
    Every collective here waits through :mod:`.waits`: a fault on another rank ends the wait."""
    waits.wait_work(_ALL_GATHER(output, input, group=group, async_op=True), output.device, "an all-gather")


def reduce_scatter_flat(output: Tensor, input: Tensor, *, group: Group | None = None) -> None:
    """``output [n, ...]`` = the sum over ranks of slot ``rank`` of ``input [P * n, ...]``."""
    waits.wait_work(_REDUCE_SCATTER(output, input, group=group, async_op=True), output.device, "a reduce-scatter")


def all_reduce(x: Tensor, *, group: Group | None = None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """``x`` = the reduction (``op``, default the sum) over ranks of ``x``, in place."""
    waits.wait_work(dist.all_reduce(x, op=op, group=group, async_op=True), x.device, "an all-reduce")


def comm_device(group: Group) -> torch.device:
    """The device a collective of ``group`` needs its tensors on: CUDA for NCCL, else the CPU."""
    if uses_nccl(group):  # "nccl", "cpu:gloo,cuda:nccl" or a bare init_process_group() ("undefined")
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

class Flag(Protocol):
    """One number per rank that rides an all-to-all to every rank (one tiny message per peer in the
    same batch), so that sharing it costs no collective of its own. ``direction`` says which
    exchange of the call carries it: ``"forward"`` or ``"backward"``."""

    direction: str

    def value(self) -> float:
        """This rank's number, read when the exchange starts."""
        ...

    def receive(self, values: list[float]) -> None:
        """Every rank's number (rank order), once the exchange is done."""
        ...


def _resized(shape: Sequence[int], sizes: dict[int, int]) -> torch.Size:
    """``shape`` with the dims of ``sizes`` set to their sizes there: ``_resized(s, {2: 5})``."""
    return torch.Size(sizes.get(d, n) for d, n in enumerate(shape))


def _by_row(pieces: list[list[Tensor]]) -> list[list[Tensor]]:
    """Each ``[B, ...]`` piece as its B rows ``[...]``."""
    return [[t[b] for t in ts for b in range(t.shape[0])] for ts in pieces]


def _exchange(sends: list[list[Tensor]], recvs: list[list[Tensor]], group: Group, flag: Flag | None = None,
              *, by_row: bool = False) -> None:
    """Every rank's ``sends[s][i]`` lands in rank s's ``recvs[r][i]`` (r: the sender): views of any
    layout, the same shape on both ends. One batch of point-to-point transfers in place of an
    ``all_to_all_single``, because its buffers cost copies: a view that is contiguous is sent from,
    or received into, where it lies (``[1, S_s, H, D]`` slices of ``[1, S, H, D]``), so an exchange
    copies once (not pack, then unpack); the piece a rank keeps is copied straight to its place
    while the others travel. ``flag`` adds one one-number message per peer.

    ``by_row``: every piece travels as its rows (``[B, n, ...] -> B x [n, ...]``): with B > 1 a
    slice along dim 1 of a contiguous tensor is not contiguous, but each of its rows is -- B
    messages instead of a landing buffer and a copy. Both ends decide it from the same shapes.
    """
    if by_row:
        sends, recvs = _by_row(sends), _by_row(recvs)
    p, me = dist.get_world_size(group), dist.get_rank(group)
    ops, landings = [], []
    for peer in (r for r in range(p) if r != me):
        dst = dist.get_global_rank(group, peer)
        for t in sends[peer]:
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t.contiguous(), dst, group=group))
        for view in recvs[peer]:
            if view.numel():
                land = view if view.is_contiguous() else torch.empty(view.shape, dtype=view.dtype, device=view.device)
                ops.append(dist.P2POp(dist.irecv, land, dst, group=group))
                if land is not view:
                    landings.append((view, land))
    if flag is not None:
        ref = next(t for per_rank in sends for t in per_rank)
        mine = torch.full((1,), flag.value(), dtype=torch.float64, device=ref.device)
        flags = torch.empty(p, dtype=torch.float64, device=ref.device)
        for peer in (r for r in range(p) if r != me):
            dst = dist.get_global_rank(group, peer)
            ops += [dist.P2POp(dist.isend, mine, dst, group=group),
                    dist.P2POp(dist.irecv, flags[peer:peer + 1], dst, group=group)]
        flags[me] = mine[0]
    reqs = dist.batch_isend_irecv(ops) if ops else []
    for t, view in zip(sends[me], recvs[me], strict=True):
        view.copy_(t)
    ref = next((t for per_rank in recvs for t in per_rank), None)
    waits.wait_requests(reqs, ref.device if ref is not None else torch.device("cpu"), "an all-to-all")
    for view, land in landings:
        view.copy_(land)
    if flag is not None:
        flag.receive(flags.tolist())


class _AllToAll(torch.autograd.Function):
    """Forward: rank r sends ``x.narrow(scatter_dim, *send_ranges[r])`` to every rank and
    concatenates what it receives along ``gather_dim``. Backward: the same exchange reversed --
    each gradient slice goes back to the rank it came from and is added into the range it was cut
    from. Ranges may overlap (a KV head replicated to several ranks); adding them sums the
    gradients of the copies, which is exactly the gradient of a replication.

    Several tensors move in one exchange (fused q, k, v). A :class:`Flag` rides the exchange of
    its direction.
    """

    @staticmethod
    def forward(ctx, group, scatter_dim, gather_dim, send_ranges, recv_sizes, flag, *xs):
        p, me = dist.get_world_size(group), dist.get_rank(group)
        sd, gd = scatter_dim, gather_dim
        outs = [x.new_empty(_resized(x.shape, {sd: rngs[me][1], gd: sum(sizes)}))
                for x, rngs, sizes in zip(xs, send_ranges, recv_sizes, strict=True)]
        sends = [[x.narrow(sd, *rngs[r]) for x, rngs in zip(xs, send_ranges, strict=True)] for r in range(p)]
        recvs = [[o.narrow(gd, sum(sizes[:s]), sizes[s]) for o, sizes in zip(outs, recv_sizes, strict=True)]
                 for s in range(p)]
        _exchange(sends, recvs, group, flag if flag is not None and flag.direction == "forward" else None,
                  by_row=_rows_help(xs[0].shape, sd, gd))
        ctx.group, ctx.scatter_dim, ctx.gather_dim, ctx.flag = group, sd, gd, flag
        ctx.send_ranges, ctx.recv_sizes = send_ranges, recv_sizes
        ctx.in_shapes = [x.shape for x in xs]
        ctx.out_shapes = [o.shape for o in outs]
        ctx.dtype, ctx.device = xs[0].dtype, xs[0].device
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        group, sd, gd, flag = ctx.group, ctx.scatter_dim, ctx.gather_dim, ctx.flag
        p = dist.get_world_size(group)
        # An output that took no part in the loss has no gradient: it still must be exchanged.
        grads = [g if g is not None else torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
                 for g, shape in zip(grads, ctx.out_shapes, strict=True)]
        # Slice the gradient by the rank each piece of the output came from ...
        sends = [[g.narrow(gd, sum(sizes[:s]), sizes[s]) for g, sizes in zip(grads, ctx.recv_sizes, strict=True)]
                 for s in range(p)]
        # ... and receive, from every rank r, the gradient of the slice we sent it: straight into
        # its range when the ranges tile the dim (the usual case), else apart, to be added.
        tiled = [_is_partition(rngs, shape[sd]) for shape, rngs in zip(ctx.in_shapes, ctx.send_ranges, strict=True)]
        dxs = [torch.empty(shape, dtype=ctx.dtype, device=ctx.device) if t else None
               for shape, t in zip(ctx.in_shapes, tiled, strict=True)]
        recvs = [[dx.narrow(sd, *rngs[r]) if dx is not None else
                  torch.empty(_resized(shape, {sd: rngs[r][1]}), dtype=ctx.dtype, device=ctx.device)
                  for dx, shape, rngs in zip(dxs, ctx.in_shapes, ctx.send_ranges, strict=True)] for r in range(p)]
        _exchange(sends, recvs, group, flag if flag is not None and flag.direction == "backward" else None,
                  by_row=_rows_help(ctx.in_shapes[0], gd, sd))
        for i, (shape, rngs) in enumerate(zip(ctx.in_shapes, ctx.send_ranges, strict=True)):
            if dxs[i] is None:  # replicated: the copies' gradients add up
                dxs[i] = torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
                for r in range(p):
                    dxs[i].narrow(sd, *rngs[r]).add_(recvs[r][i])
        return (None, None, None, None, None, None, *dxs)


def _rows_help(shape: Sequence[int], send_dim: int, recv_dim: int) -> bool:
    """Whether an exchange cutting ``send_dim`` and landing along ``recv_dim`` should move row by
    row (see :func:`_exchange`): B > 1 and one of the two dims is 1, the dim right after the rows
    (Ulysses' ``[B, S, H, D]``: the sequence), so that each row's piece lies contiguous on that end."""
    return shape[0] > 1 and 1 in (send_dim, recv_dim)


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
                     recv_sizes: Sequence[Sequence[int]], flag: Flag | None = None) -> tuple[Tensor, ...]:
    """Fused all-to-all of several tensors in one exchange (one batch of point-to-point
    transfers, see :func:`_exchange`), with autograd.

    ``send_ranges[i][r] = (start, length)``: the slice of ``xs[i]`` along ``scatter_dim`` that goes
    to rank r (ranges may overlap: replication). ``recv_sizes[i][s]``: the size along
    ``gather_dim`` of what rank s sends for ``xs[i]``. Outputs are concatenated along
    ``gather_dim`` in rank order (contiguous tensors). All tensors must share a dtype. ``flag``: a
    number every rank shares through the exchange of ``flag.direction`` (see :class:`Flag`).
    """
    if len({x.dtype for x in xs}) != 1:
        raise ValueError(f"fused all-to-all needs one dtype, got {[x.dtype for x in xs]}")
    nd = xs[0].dim()
    sd, gd = scatter_dim % nd, gather_dim % nd
    if sd == gd:
        raise ValueError(f"scatter_dim and gather_dim must differ, both are {sd}")
    send_ranges = tuple(tuple((int(a), int(b)) for a, b in rngs) for rngs in send_ranges)
    recv_sizes = tuple(tuple(int(s) for s in sizes) for sizes in recv_sizes)
    if torch.compiler.is_compiling():
        if flag is not None:
            raise ValueError("a failure flag cannot ride a traced all-to-all: compiled calls check failures in ops")
        return _traced_all_to_all(xs, sd, gd, group, send_ranges, recv_sizes)
    return _AllToAll.apply(group, sd, gd, send_ranges, recv_sizes, flag, *xs)


def _traced_all_to_all(xs: Sequence[Tensor], sd: int, gd: int, group: Group,
                       send_ranges: Sequence[Sequence[tuple[int, int]]],
                       recv_sizes: Sequence[Sequence[int]]) -> tuple[Tensor, ...]:
    """:func:`all_to_all_multi` as torch's functional ``all_to_all_single`` (differentiable: its
    backward is the reverse exchange), for ``torch.compile`` to trace: every piece for rank r is
    flattened into one send buffer in rank order, and what arrives is cut back into pieces and
    concatenated along ``gather_dim``. The narrows' backward adds the gradients of replicated
    ranges, as :class:`_AllToAll`'s does. Costs a pack and an unpack copy more than the eager one."""
    p, me = dist.get_world_size(group), dist.get_rank(group)
    send, in_splits = [], []
    for r in range(p):
        pieces = [x.narrow(sd, *rngs[r]).reshape(-1) for x, rngs in zip(xs, send_ranges, strict=True)]
        send += pieces
        in_splits.append(sum(t.numel() for t in pieces))
    shapes = [[_resized(x.shape, {sd: rngs[me][1], gd: sizes[s]})
               for x, rngs, sizes in zip(xs, send_ranges, recv_sizes, strict=True)] for s in range(p)]
    out_splits = [sum(math.prod(shape) for shape in shapes[s]) for s in range(p)]
    got = funcol.all_to_all_single_autograd(torch.cat(send), out_splits, in_splits, group)
    per_rank = [chunk.split([math.prod(shape) for shape in shapes[s]])
                for s, chunk in enumerate(got.split(out_splits))]
    return tuple(torch.cat([per_rank[s][i].view(shapes[s][i]) for s in range(p)], dim=gd) for i in range(len(xs)))


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
