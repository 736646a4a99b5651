"""Ulysses (DeepSpeed-Ulysses style) sequence-parallel attention.

Each rank holds a shard of the sequence with all heads. One fused all-to-all trades it for the
whole sequence with a subset of heads, any local kernel attends, and one all-to-all trades back
(:mod:`seqpar.attention.heads`)::

    q, k, v   # [B, S/P, H, D], [B, S/P, H_kv, D]      sequence shard, all heads
      | all-to-all (q, k, v fused): scatter heads, gather sequence
    q, k, v   # [B, S, H/P, D], [B, S, H_kv', D]       whole sequence, this rank's heads
      | local kernel
    out       # [B, S, H/P, D]
      | all-to-all: scatter sequence, gather heads
    out       # [B, S/P, H, D]

``H % P != 0`` and ``H_kv < P`` need no special case; sinks follow the query heads. The local
kernel runs under a :class:`~seqpar.comm.guard.Guard`: a rank whose kernel raises sends zeros
through the output all-to-all (and zero gradients through the backward one), and every rank raises
at the fence that ends the call in each direction -- or, for a batch's SeqShard under autograd, at
the batch's check (:mod:`seqpar.comm.guard`). The entry is the shared pipeline:
:func:`~seqpar.attention.call.prepare`, then :func:`~seqpar.attention.run.run`.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from typing_extensions import Unpack

from .call import AttnOptions, Groups, prepare
from .run import run


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup,
                      **options: Unpack[AttnOptions]) -> Tensor:
    """Exact attention over the whole sequence from sequence shards, via two all-to-alls.

    ``q [B, S_local, H, D]``, ``k [B, S_local, H_kv, D]``, ``v [B, S_local, H_kv, Dv]``: this
    rank's tokens (local lengths may differ between ranks: any split, tensor_split's the usual
    one). ``group``: the sequence-parallel process group (``mesh.get_group("sp")``). ``options``:
    :class:`~seqpar.attention.call.AttnOptions` -- causal, scale, window, chunk, softcap, sinks,
    dropout, kernel (default ``"auto"``: ``sdpa`` where its causal flag suffices, else the device's
    varlen lse kernel), key_padding_mask / segment_ids or the batch's shard, layout, validate.

    Returns a contiguous ``[B, S_local, H, Dv]``. Raises ValueError on every rank for inconsistent
    inputs; an exception in one rank's kernel is raised on every rank (see :mod:`seqpar.comm.guard`:
    checked per call, or once per batch when ``shard`` is the batch's and autograd is on).
    """
    return run(prepare(q, k, v, Groups(ulysses=group), options, caller="ulysses_attention"), q, k, v)
