"""Rows of a tensor sent to the ranks that need them, in one exchange, with autograd.

The vision side of a sequence-parallel vision-language model: each rank encodes a share of the
batch's images, and every image-token embedding must reach the rank whose sequence shard holds
that token. Which rows go where is a plan every rank computes alike (pure, from the batch); the
rows themselves travel in one ``all_to_all_single`` with uneven split sizes::

    rank 0  x  [N_0, E]  rows 0..N_0-1           send_index[d]: the rows rank d needs, in its order
    rank 1  x  [N_1, E]  rows 0..N_1-1           recv_counts[s]: how many rows rank s sends here
      | all_to_all_single (split sizes)
    rank d  out [sum_s recv_counts[s], E]        rank 0's rows for d, then rank 1's, ...

A rank that needs nothing, or holds nothing, still takes part (zero-size pieces): the exchange is
collective in both directions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import waits
from .collectives import Group


def exchange_rows(x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group: Group) -> Tensor:
    """``x [sum(send_counts), E]`` cut into per-rank pieces -> ``[sum(recv_counts), E]`` in rank order
    (one ``all_to_all_single`` with split sizes, no autograd: the autograd Functions built on it say
    what their backward sends)."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv_counts),
                                  input_split_sizes=list(send_counts), group=group, async_op=True)
    waits.wait_work(work, out.device, "an all-to-all of rows")
    return out


class _RouteRows(torch.autograd.Function):
    """Forward: rank r sends ``x[send_index[d]]`` to every rank d and concatenates what it receives
    in source-rank order. Backward: the same exchange reversed -- each received row's gradient
    goes back to the rank that sent it and is added into the row it was taken from. A row sent
    to several ranks (or twice) was used several times, so its gradient is the sum of theirs;
    a row sent nowhere gets zero (no rank's loss read it)."""

    @staticmethod
    def forward(ctx, x, send_index, recv_counts, group):
        flat = torch.cat(send_index) if send_index else x.new_zeros(0, dtype=torch.long)
        send_counts = [int(i.numel()) for i in send_index]
        ctx.save_for_backward(flat)
        ctx.shape, ctx.send_counts, ctx.recv_counts, ctx.group = x.shape, send_counts, list(recv_counts), group
        return exchange_rows(x.index_select(0, flat), send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, g):
        (flat,) = ctx.saved_tensors
        back = exchange_rows(g, ctx.recv_counts, ctx.send_counts, ctx.group)  # [sum(send_counts), E]
        dx = g.new_zeros(ctx.shape).index_add_(0, flat, back)
        return dx, None, None, None


def route_rows(x: Tensor, send_index: Sequence[Tensor], recv_counts: Sequence[int], *, group: Group) -> Tensor:
    """Send ``x[send_index[d]]`` to each rank d of ``group``; return the rows received,
    ``[sum(recv_counts), ...]``, in source-rank order. One ``all_to_all_single``, forward and
    backward (see :class:`_RouteRows`); every rank of the group must call it, with plans that
    agree (``recv_counts[s]`` here equals ``len(send_index[here])`` on rank s).

    ``x [N, ...]``; ``send_index``: one long tensor of row indices per rank (empty for none);
    ``recv_counts``: rows expected from each rank. Under autograd the exchange is recorded
    even when ``x`` needs no gradient on this rank (no rows, a frozen encoder): its backward is
    a collective too, and a rank that skipped it would leave the others waiting.
    """
    p = dist.get_world_size(group)
    if len(send_index) != p or len(recv_counts) != p:
        raise ValueError(f"route_rows needs one send index and one receive count per rank ({p}), got "
                         f"{len(send_index)} and {len(recv_counts)}")
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_()
    index = [i.to(device=x.device, dtype=torch.long).reshape(-1) for i in send_index]
    return _RouteRows.apply(x, index, tuple(int(n) for n in recv_counts), group)
