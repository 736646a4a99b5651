"""The halo exchange: each rank receives the last tokens of the previous rank's shard, with autograd.

A causal convolution of width ``k`` over a sequence sharded contiguously needs, at rank r, the last
``k - 1`` inputs of rank r - 1 (rank 0 starts the sequence: nothing)::

    rank:      r0           r1           r2
    shard:  [a0 .. a5]   [b0 .. b5]   [c0 .. c5]
    halo:      -          [a4 a5]      [b4 b5]      (k - 1 = 2)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import waits
from .collectives import Group


def _shift(send: Tensor | None, to: int | None, recv: Tensor | None, frm: int | None, group: Group) -> None:
    """Send ``send`` to group rank ``to`` and receive ``recv`` from group rank ``frm`` (either may be None)."""
    ops = []
    if send is not None and to is not None:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), dist.get_global_rank(group, to), group=group))
    if recv is not None and frm is not None:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, frm), group=group))
    if ops:
        waits.wait_requests(dist.batch_isend_irecv(ops), ops[0].tensor.device, "a halo exchange")


class _Halo(torch.autograd.Function):
    """Forward: send my last ``width`` tokens to the next rank, receive the previous rank's (rank 0:
    an empty halo). Backward: the reverse -- the halo's gradient goes back to the rank it came from,
    which adds it to the gradient of its last ``width`` tokens (they were used there, and here)."""

    @staticmethod
    def forward(ctx, x, width, dim, group):
        p, me = dist.get_world_size(group), dist.get_rank(group)
        n = x.shape[dim]
        ctx.width, ctx.dim, ctx.group, ctx.n = width, dim, group, n
        shape = list(x.shape)
        shape[dim] = width if me > 0 else 0
        halo = x.new_empty(shape)
        _shift(x.narrow(dim, n - width, width) if me < p - 1 else None, me + 1 if me < p - 1 else None,
               halo if me > 0 else None, me - 1 if me > 0 else None, group)
        return halo

    @staticmethod
    def backward(ctx, g):
        p, me = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        shape = list(g.shape)
        shape[ctx.dim] = ctx.n
        dx = g.new_zeros(shape)
        last = me == p - 1  # the last rank sent nothing
        tail = None if last else dx.narrow(ctx.dim, ctx.n - ctx.width, ctx.width)
        got = None if tail is None else torch.empty_like(tail)
        _shift(g if me > 0 else None, me - 1 if me > 0 else None, got, None if last else me + 1, ctx.group)
        if tail is not None and got is not None:
            tail.add_(got)
        return dx, None, None, None


def halo_exchange(x: Tensor, width: int, *, dim: int = 1, group: Group) -> Tensor:
    """The previous rank's last ``width`` entries of ``x`` along ``dim`` (``[B, width, ...]`` for
    ``dim=1``; empty on group rank 0), with autograd. Every rank's shard but the last must hold at
    least ``width`` entries along ``dim`` (the caller checks, on every rank alike). One point-to-point
    exchange each way."""
    dim = dim % x.dim()
    last = dist.get_rank(group) == dist.get_world_size(group) - 1
    if width < 0 or (not last and width > x.shape[dim]):
        raise ValueError(f"a halo of {width} entries needs shards at least that long (this one has {x.shape[dim]})")
    return _Halo.apply(x, width, dim, group)
