"""Per-token log-probabilities from vocabulary-parallel logits: each tp rank holds ``[N, V/tp]``, no
rank ever holds ``[N, V]`` (Megatron's vocab-parallel cross entropy).

Rank r of the tp group holds the logits of vocabulary rows ``vocab_range(V, tp, r)`` (the
``Shard(0)`` split of the head's weight: ``torch.chunk``'s, the first ranks one row more where ``tp``
does not divide ``V``)::

    z        # [N, V/tp]                 this rank's vocabulary shard of the logits
    m        = all-reduce MAX of the rows' local maxima           # [N]
    s, t     = all-reduce SUM of (sum exp(z - m), target logit or 0)  # [N], [N] in one buffer
    logp     = t - m - log(s)                                      # [N], the same on every tp rank

Backward (no collective): ``d logp / d z = onehot(target) - softmax(z)``, restricted to this rank's
rows -- each rank needs only its own shard's gradient, and the incoming gradient is the same on
every tp rank (the loss is). The head's input gradient, partial over tp, is all-reduced by the
head's column style (:mod:`seqpar.integrations.distributed.tensor_parallel`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import collectives


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """``(start, end)`` of the vocabulary rows tp rank ``rank`` holds: ``torch.chunk``'s split of
    ``vocab`` rows into ``tp`` (what a ``Shard(0)`` DTensor holds). Pure."""
    size = -(-vocab // tp)
    start = min(rank * size, vocab)
    return start, min(start + size, vocab)


def local_targets(targets: Tensor, start: int, width: int) -> tuple[Tensor, Tensor]:
    """``(index into this rank's rows [N] (clamped), whether the target is one of them [N])``."""
    here = (targets >= start) & (targets < start + width)
    return (targets - start).clamp(0, max(width - 1, 0)), here


@torch.no_grad()
def vocab_parallel_terms(z: Tensor, targets: Tensor, start: int, group: dist.ProcessGroup
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """``(logsumexp over the whole vocabulary [N], the target's logit [N] (0 where ignored),
    exp(z - max) [N, V/tp])`` from this rank's shard ``z [N, V/tp]``: the two all-reduces of the
    module doc, no autograd (callers write the backward: ``softmax - onehot``)."""
    idx, here = local_targets(targets, start, z.shape[1])
    m = z.max(dim=1).values if z.shape[1] else z.new_full((z.shape[0],), float("-inf"))
    collectives.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = (z - m[:, None]).exp_()  # [N, V/tp]
    picked = z.gather(1, idx[:, None]).squeeze(1) * here if z.shape[1] else z.new_zeros(z.shape[0])
    sums = torch.stack([e.sum(1), picked])  # [2, N]: one buffer, one all-reduce
    collectives.all_reduce(sums, group=group)
    return m + sums[0].log(), sums[1], e


class _VocabParallelLogProb(torch.autograd.Function):
    """Forward: two all-reduces over the tp group (MAX of the row maxima, then SUM of the shifted
    exponentials and the target's logit, which one rank holds). Backward: ``(onehot - softmax) *
    grad`` on this rank's rows only, no collective (module doc)."""

    @staticmethod
    def forward(ctx, z: Tensor, targets: Tensor, start: int, group: dist.ProcessGroup) -> Tensor:
        # z [N, V/tp] in compute dtype, targets [N] (global ids; ignore_index rows masked by the caller)
        lse, picked, _ = vocab_parallel_terms(z, targets, start, group)
        idx, here = local_targets(targets, start, z.shape[1])
        ctx.save_for_backward(z, lse, idx, here)
        return picked - lse

    @staticmethod
    def backward(ctx, grad: Tensor):
        z, lse, idx, here = ctx.saved_tensors
        dz = (z - lse[:, None]).exp_().neg_()  # -softmax on this rank's rows
        dz.scatter_add_(1, idx[:, None], here.to(dz.dtype)[:, None])  # + onehot where the target is here
        return dz.mul_(grad[:, None]), None, None, None


def vocab_parallel_log_probs(logits: Tensor, targets: Tensor, group: dist.ProcessGroup, vocab: int,
                             ignore_index: int) -> Tensor:
    """``log p(target)`` ``[B, S]`` (0 where ``targets == ignore_index``) from this rank's vocabulary
    shard ``logits [B, S, V/tp]`` of a ``vocab``-row head split over ``group``; differentiable, the
    same values on every rank of ``group``; computed in at least float32. Raises ValueError when the
    shard is not the width :func:`vocab_range` gives this rank (logits not split as the head is)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    start, end = vocab_range(vocab, tp, rank)
    if logits.shape[-1] != end - start:
        raise ValueError(f"tensor-parallel logits of width {logits.shape[-1]} on tp rank {rank}, but a {vocab}-row "
                         f"vocabulary split over tp={tp} gives it {end - start}: the head is not split as seqpar "
                         "splits it (seqpar.parallelize does)")
    cdtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits.reshape(-1, logits.shape[-1]).to(cdtype)
    flat = targets.reshape(-1).to(z.device)
    valid = flat != ignore_index
    logp = _VocabParallelLogProb.apply(z, torch.where(valid, flat, -1), start, group)
    return (logp * valid).view(targets.shape)
