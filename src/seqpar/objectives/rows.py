"""Sequences whose tokens are spread over the SP ranks: which sequence each local token belongs to,
where each sequence ends, and per-sequence sums with autograd.

A *sequence* is one document of one row: a padded row is one sequence (its real tokens), a packed
row holds one per document. Sequences are numbered row by row, documents in order, the same on
every SP rank (the numbering is a pure function of the batch's metadata, which every rank holds
whole in its :class:`~seqpar.attention.shard.SeqShard`)::

    row 0   [ c0 c0 c0 | c0 r0 r0 ]     (| = shard boundary, packed: two documents)
    row 1   [ c1 c1 c1 | c1 pd pd ]     (pd = padding: no sequence, id -1)
    ids       0: c0, 1: r0, 2: c1

A per-sequence sum is each rank's partial sum over its own tokens, all-reduced over the SP group
(:class:`_SameLossRowSum`): every rank then holds the whole sequences' sums and computes the same
loss from them, while the gradient reaches each rank's own tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention.shard import SeqShard
from ..batch.local_batch import LocalBatch
from ..comm import backward_faults, collectives


@dataclass(frozen=True)
class Sequences:
    """This rank's view of the batch's sequences.

    ids     [B, S_local] long: the sequence of each local token, -1 at padding
    last    [B, S_local] bool: the token is its sequence's last real token (each sequence has
            exactly one, on exactly one rank)
    count   how many sequences the batch holds (the same on every SP rank)
    """

    ids: Tensor
    last: Tensor
    count: int


def batch_sequences(shard: SeqShard, b: int, device: torch.device) -> tuple[Tensor, Tensor, int]:
    """``(ids [B, S], last [B, S], count)`` over the whole batch in layout order."""
    s = sum(shard.seq_lens)
    keep = torch.ones(b, s, dtype=torch.bool, device=device) if shard.key_keep is None else \
        shard.key_keep.to(device).expand(b, s)
    seg = torch.zeros(b, s, dtype=torch.long, device=device) if shard.segments is None else \
        shard.segments.to(device, torch.long).expand(b, s)
    code = (torch.arange(b, device=device)[:, None] * (s + 1) + seg).masked_fill(~keep, -1)  # [B, S]
    uniq, inv = torch.unique(code, return_inverse=True)  # sorted: row by row, documents in order
    pad = int(uniq.numel() > 0 and int(uniq[0]) < 0)
    ids = (inv - pad).masked_fill(~keep, -1)
    count = uniq.numel() - pad
    orig = torch.arange(s, device=device) if shard.positions is None else shard.positions.to(device)
    orig = orig.expand(b, s)  # [B, S] the original index of each layout position
    end = torch.full((count,), -1, dtype=torch.long, device=device)
    end = end.scatter_reduce(0, ids[keep], orig[keep], reduce="amax")  # [count] last original index
    last = keep & (orig == end[ids.clamp(min=0)])
    return ids, last, count


def sequences(batch: LocalBatch, b: int, device: torch.device) -> Sequences:
    """The batch's sequences as this rank sees them (no communication: from the shard's metadata)."""
    shard = batch.shard
    ids, last, count = batch_sequences(shard, b, device)
    start = sum(shard.seq_lens[:batch.sp_rank])
    n = shard.seq_lens[batch.sp_rank]
    return Sequences(ids[:, start:start + n], last[:, start:start + n], count)


def local_tokens(column: Tensor, batch: LocalBatch, device: torch.device, *, shift: bool = True) -> Tensor:
    """This rank's slice ``[B, S_local, ...]`` of a per-token input given whole ``[B, S, ...]`` in
    the original order. ``shift``: the input is aligned with the labels (its entry ``i`` belongs to
    token ``i``), and is moved to the position that predicts token ``i`` -- as shard_batch shifts the
    labels, so an entry for a shard's first token lands on the previous rank::

        column    -  a  b | c  d  e        (aligned with labels; | = shard boundary)
        shifted   a  b  c | d  e  0        rank 0 keeps "c", the value for its last target
    """
    shard = batch.shard
    s = sum(shard.seq_lens)
    if column.dim() < 2 or column.shape[1] != s:
        raise ValueError(f"a per-token input must be [batch, {s}, ...] (the whole rows, before sharding), "
                         f"got {list(column.shape)}")
    col = column.to(device)
    if shift:
        col = torch.cat([col[:, 1:], torch.zeros_like(col[:, :1])], dim=1)
    if shard.positions is not None:
        col = col.index_select(1, shard.positions.to(device))
    start = sum(shard.seq_lens[:batch.sp_rank])
    return col[:, start:start + shard.seq_lens[batch.sp_rank]]


_SUM_DTYPE = torch.float64  # row sums accumulate in float64 (see row_sums)


class _SameLossRowSum(torch.autograd.Function):
    """Forward: all-reduce (sum) each rank's per-sequence partial sums ``[N, ...]`` over the SP
    group: every rank holds the whole sequences' sums. Backward: the incoming gradient times the SP
    size, no collective.

    Why no collective: the seam computes the same loss on every SP rank from these sums, so the
    incoming gradient is the same everywhere, and a partial enters its sum with coefficient 1 -- its
    gradient is that incoming gradient. The factor P pre-scales this rank's share for the average
    over the SP ranks that DDP / FSDP2 / :func:`seqpar.sync_gradients` take afterwards (the
    convention of :mod:`seqpar.batch.loss`). The textbook backward of an all-reduce (all-reducing the
    gradient) gives the same ``P * g`` when every rank's loss is the same, at the cost of a collective."""

    @staticmethod
    def forward(ctx, partial: Tensor, group: dist.ProcessGroup | None, p: int) -> Tensor:
        total = partial.detach().clone()
        if group is not None and p > 1:
            collectives.all_reduce(total, group=group)
        ctx.p = p
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        backward_faults.backward_started()  # a failure from here on is told to every rank
        return grad * ctx.p, None, None


def row_sums(values: Tensor, seqs: Sequences, group: dist.ProcessGroup | None) -> Tensor:
    """Per-sequence sums over the whole sequences, on every SP rank: ``values [B, S_local, ...]``
    (0 where a token should not count) -> ``[N, ...]``. Differentiable (see :class:`_SameLossRowSum`).

    The partial sums and their all-reduce are float64 whatever ``values``' dtype, and the total is
    rounded back once: a float32 sum of a 16k-token row's log-probs, accumulated token by token on
    each rank and then across ranks, depended on P (a DPO loss of 3.766 at sp=1 against 3.607 at
    sp=4 from the same weights); in float64 both are the float64 sum rounded once."""
    keep = seqs.ids >= 0
    flat = values[keep].to(_SUM_DTYPE)  # [T, ...] this rank's tokens that belong to a sequence
    partial = flat.new_zeros((seqs.count, *values.shape[2:])).index_add(0, seqs.ids[keep], flat)
    p = 1 if group is None else dist.get_world_size(group)
    return _SameLossRowSum.apply(partial, group, p).to(values.dtype)
