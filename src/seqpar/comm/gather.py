"""All-gather and split along the sequence, with autograd, for uneven shards; a summing all-reduce."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import collectives
from .collectives import Group, split_offsets, split_sizes


def gather_padded(x: Tensor, dim: int, sizes: Sequence[int], group: Group) -> Tensor:
    """All-gather uneven shards: pad to the largest, gather once, cut the padding away."""
    p, longest = len(sizes), max(sizes)
    xt = x.movedim(dim, 0)
    if xt.shape[0] < longest:
        xt = torch.cat([xt, xt.new_zeros((longest - xt.shape[0], *xt.shape[1:]))])
    buf = xt.new_empty((p * longest, *xt.shape[1:]))
    collectives.all_gather_flat(buf, xt.contiguous(), group=group)
    parts = [buf[r * longest: r * longest + sizes[r]] for r in range(p)]
    return torch.cat(parts).movedim(0, dim)


def _reduce_scatter_padded(x: Tensor, dim: int, sizes: Sequence[int], group: Group) -> Tensor:
    """Sum ``x`` over ranks and keep this rank's shard (uneven shards padded to the largest)."""
    p, longest, me = len(sizes), max(sizes), dist.get_rank(group)
    xt = x.movedim(dim, 0)
    offs = split_offsets(sizes)
    padded = xt.new_zeros((p * longest, *xt.shape[1:]))
    for r in range(p):
        padded[r * longest: r * longest + sizes[r]] = xt[offs[r]: offs[r] + sizes[r]]
    out = xt.new_empty((longest, *xt.shape[1:]))
    collectives.reduce_scatter_flat(out, padded, group=group)
    return out[: sizes[me]].movedim(0, dim)


class _GatherSeq(torch.autograd.Function):
    """Forward: all-gather the shards along ``dim``. Backward: reduce-scatter -- every rank used
    the whole gathered tensor, so the gradient of a shard is the sum of all ranks' gradients of
    its slice (use ``split_seq(gather_seq(...))``-style pairs with care: see ``grad``)."""

    @staticmethod
    def forward(ctx, x, dim, sizes, group, grad):
        ctx.dim, ctx.sizes, ctx.group, ctx.grad = dim, sizes, group, grad
        return gather_padded(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad == "slice":
            me = dist.get_rank(ctx.group)
            return g.narrow(ctx.dim, sum(ctx.sizes[:me]), ctx.sizes[me]), None, None, None, None
        return _reduce_scatter_padded(g, ctx.dim, ctx.sizes, ctx.group), None, None, None, None


class _SplitSeq(torch.autograd.Function):
    """Forward: keep this rank's shard of a tensor every rank holds whole. Backward: all-gather the
    shards' gradients, so each rank gets the gradient of the whole tensor (the copies were equal,
    and each rank's loss only touched its shard)."""

    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        me = dist.get_rank(group)
        return x.narrow(dim, sum(sizes[:me]), sizes[me]).contiguous()

    @staticmethod
    def backward(ctx, g):
        return gather_padded(g.contiguous(), ctx.dim, ctx.sizes, ctx.group), None, None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """Forward: sum a tensor every rank holds whole (each its own partial sum, ``[B, S, ...]``) over
    the ranks and keep this rank's shard. Backward: all-gather the shards' gradients -- each
    rank's partial entered every shard of the sum with coefficient 1, so its gradient is the
    whole sum's gradient."""

    @staticmethod
    def forward(ctx, x, dim, sizes, group):
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return _reduce_scatter_padded(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return gather_padded(g.contiguous(), ctx.dim, ctx.sizes, ctx.group), None, None, None


def _sizes_for(n_local: int | None, total: int | None, sizes: Sequence[int] | None, group: Group) -> list[int]:
    p = dist.get_world_size(group)
    if sizes is not None:
        if len(sizes) != p:
            raise ValueError(f"sizes has {len(sizes)} entries for a group of {p} ranks")
        return [int(s) for s in sizes]
    if total is not None:
        return split_sizes(total, p)
    assert n_local is not None
    return [n_local] * p


def gather_seq(x: Tensor, *, dim: int = 1, group: Group, sizes: Sequence[int] | None = None,
               grad: str = "sum") -> Tensor:
    """All-gather sequence shards (``[B, S/P, ...] -> [B, S, ...]``) with autograd.

    ``sizes``: each rank's shard length (default: all equal to this one's). ``grad="sum"``
    (default) reduce-scatters the gradient, right when ranks use the gathered tensor differently;
    ``grad="slice"`` keeps this rank's slice, right when every rank computes the same thing from it.
    """
    if grad not in ("sum", "slice"):
        raise ValueError(f"grad must be 'sum' or 'slice', got {grad!r}")
    dim = dim % x.dim()
    return _GatherSeq.apply(x, dim, tuple(_sizes_for(x.shape[dim], None, sizes, group)), group, grad)


def split_seq(x: Tensor, *, dim: int = 1, group: Group, sizes: Sequence[int] | None = None) -> Tensor:
    """This rank's shard of a tensor every rank holds whole (tensor_split convention unless
    ``sizes`` is given); the backward all-gathers."""
    dim = dim % x.dim()
    return _SplitSeq.apply(x, dim, _whole_sizes(x, dim, sizes, group), group)


def _whole_sizes(x: Tensor, dim: int, sizes: Sequence[int] | None, group: Group) -> tuple[int, ...]:
    """The shard lengths of a tensor every rank holds whole along ``dim``, checked to cover it."""
    out = tuple(_sizes_for(None, x.shape[dim], sizes, group))
    if sum(out) != x.shape[dim]:
        raise ValueError(f"sizes {list(out)} sum to {sum(out)}, but dim {dim} has {x.shape[dim]}")
    return out


def reduce_scatter_seq(x: Tensor, *, dim: int = 1, group: Group, sizes: Sequence[int] | None = None) -> Tensor:
    """Sum per-rank partials of a whole sequence over ``group`` and keep this rank's shard
    (``[B, S, ...] -> [B, S/P, ...]``, tensor_split convention unless ``sizes``); the backward
    all-gathers. The dual of :func:`gather_seq`: a layer that splits its work by heads runs on the
    gathered sequence and returns its partial output through this."""
    dim = dim % x.dim()
    return _ReduceScatterSeq.apply(x, dim, _whole_sizes(x, dim, sizes, group), group)


class _AllReduceSum(torch.autograd.Function):
    """Forward: the sum over ranks of a tensor every rank holds (its own partial). Backward: the
    sum over ranks of the gradient -- every rank's output is the same sum, and each rank's loss
    may read it, so a partial's gradient is the total of the outputs' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        collectives.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        collectives.all_reduce(g, group=ctx.group)
        return g, None


def all_reduce_sum(x: Tensor, *, group: Group) -> Tensor:
    """Sum per-rank partials over ``group`` with autograd (for a layer whose channels are spread
    over the ranks: a partial matrix product, a partial sum of squares)."""
    return _AllReduceSum.apply(x, group)
