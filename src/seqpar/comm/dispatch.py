"""Token dispatch for expert parallelism: rows to the ranks that own their experts, and back.

Each rank of an expert-parallel group holds some of a layer's experts and its own tokens. A token
routed to k experts is k rows, each sent to the owner of its expert; the owner runs its experts on
what it received and sends every result back to where the row came from. Both moves are one
``all_to_all_single`` with uneven split sizes (:func:`seqpar.comm.route.exchange_rows`), after one
tiny exchange of per-expert counts that tells every owner how many rows come from each source::

    rank r   rows [N_r, H]   sorted by expert (so by owner)    counts_r[e]: rows of r for expert e
      exchange_counts        rank d gets counts_r of d's experts  ->  recv[s][j] on rank d
      all_to_all_rows        send[d]: rows for d's experts         ->  [sum_s sum_j recv[s][j], H] on d
    owner d  runs its experts on what it received (source-major, then by expert)
      all_to_all_rows        the same exchange reversed (split sizes swapped)  ->  [N_r, H] back on r

Empty pieces are normal (an expert no token picked, a rank whose tokens all went elsewhere): a
rank with nothing to send or receive still takes part, in both directions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import Group
from .route import exchange_rows


class _AllToAllRows(torch.autograd.Function):
    """Forward: ``x [sum(send_counts), ...]`` -- this rank's ``send_counts[d]`` rows, in rank
    order, go to rank d -- becomes ``[sum(recv_counts), ...]``, rank 0's rows first. Backward: the
    same exchange with the split sizes swapped. An all-to-all puts every row in exactly one place (a
    permutation of all ranks' rows), so its adjoint is the inverse permutation: the gradient of a
    received row goes back to the rank and the slot it came from, and nothing is summed."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        return exchange_rows(x, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, g):
        return exchange_rows(g.contiguous(), ctx.recv_counts, ctx.send_counts, ctx.group), None, None, None


def all_to_all_rows(x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], *, group: Group) -> Tensor:
    """Rows to ranks, with autograd (see :class:`_AllToAllRows`): ``x [sum(send_counts), ...]``,
    its first ``send_counts[0]`` rows to rank 0 of ``group``, the next to rank 1, ...; returns
    ``[sum(recv_counts), ...]``, the rows from rank 0 first. Every rank of the group calls it with
    counts that agree (``recv_counts[s]`` here is ``send_counts[here]`` on rank s).

    Under autograd the exchange is recorded even when ``x`` needs no gradient here (no rows, or
    rows no parameter produced): its backward is a collective too, which every rank must join.
    Raises ValueError when the counts do not have one entry per rank or do not match ``x``."""
    p = dist.get_world_size(group)
    send, recv = tuple(int(n) for n in send_counts), tuple(int(n) for n in recv_counts)
    if len(send) != p or len(recv) != p:
        raise ValueError(f"all_to_all_rows needs one send and one receive count per rank ({p}), got "
                         f"{len(send)} and {len(recv)}")
    if sum(send) != x.shape[0]:
        raise ValueError(f"send_counts {list(send)} sum to {sum(send)}, but x has {x.shape[0]} rows")
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_()
    return _AllToAllRows.apply(x.contiguous(), send, recv, group)


def exchange_counts(counts: Tensor, owned: Sequence[int], *, group: Group, check: int) -> list[list[int]]:
    """How many rows every rank sends to each of this rank's experts: ``counts [E]`` this rank's
    rows per expert (global expert ids); ``owned[d]``: the number of experts rank d owns, in rank
    order (``sum(owned) == E``, each rank a contiguous range). Returns ``recv[s][j]``, the rows rank
    s sends for this rank's j-th expert. One ``all_to_all_single`` of ``E + P`` integers, no autograd.

    ``check`` (the row width) rides along to every rank: each rank receives every peer's, and a
    rank that sees one differ from its own raises ValueError -- so all of them do, before the row
    exchange, whose split sizes would not pair up."""
    p, me = dist.get_world_size(group), dist.get_rank(group)
    if len(owned) != p or sum(owned) != counts.numel():
        raise ValueError(f"owned={list(owned)} must list one expert count per rank ({p}) summing to the "
                         f"{counts.numel()} counts")
    starts = [sum(owned[:d]) for d in range(p)]
    tag = counts.new_full((1,), int(check))
    send = torch.cat([torch.cat([counts[starts[d]:starts[d] + owned[d]], tag]) for d in range(p)])  # [E + P]
    got = exchange_rows(send.to(torch.int64), [n + 1 for n in owned], [owned[me] + 1] * p, group)
    table = got.view(p, owned[me] + 1).tolist()  # the layer's one host read
    widths = [row[-1] for row in table]
    if any(w != int(check) for w in widths):
        raise ValueError(f"the ranks of an expert-parallel group disagree on the width of the rows they exchange: "
                         f"{widths} (rank 0..{p - 1}); every rank must run the same model")
    return [row[:-1] for row in table]
