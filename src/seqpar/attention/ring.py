"""Ring attention: each rank keeps its queries while K/V blocks travel around the ring.

One loop serves every variant (:mod:`seqpar.attention.ring_loop`)::

    step:      0        1        2        3          (P = 4, rank 2)
    K/V from:  r2  ->   r1  ->   r0  ->   r3          block of rank (2 - t) % 4
    queries:   q2       q2       q2       q2          never move

Layouts (contiguous, zigzag, doc-zigzag) are token permutations: a block's causal / window
visibility comes from the global positions of its tokens (``SeqShard.positions``), so nothing in
the loop knows the layout. The positions, padding mask and segment ids of every block are
batch-level facts already in the :class:`~seqpar.attention.shard.SeqShard` on every rank, so only
K and V travel. A block that causal/window hide entirely is skipped, and a partly hidden one is
trimmed to the bounding box of its visible pairs (with zigzag this halves every off-diagonal block
and removes its mask).

How K/V travel is a small swappable object (:mod:`seqpar.attention.ring_comm`): ``"p2p"`` (one hop
per step, the next block's transfer overlapping this block's compute; backward sends dK/dV one step
behind, so each returns to its owner; no rank ever holds more than two K/V blocks) or
``"allgather"`` (gather K/V once; the backward reduce-scatters dK/dV). Unequal local lengths travel
padded to the longest shard (at most a few tokens with tensor_split-style splits); the padding is
never attended.

Attention sinks are one more partial result, folded into the merged ``(out, lse)`` after the loop
(:func:`seqpar.attention.blocks.fold_sinks`); the backward then uses the folded ones, and each
rank's d sinks covers its own queries. The local compute runs under a
:class:`~seqpar.comm.guard.Guard`: a rank whose kernel raises keeps passing blocks on without
computing, and every rank raises at the fence after the loop (forward) or at the inputs (backward)
-- or, for a batch's SeqShard under autograd, at the batch's check (:mod:`seqpar.comm.guard`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from typing_extensions import Unpack

from .call import Groups, RingOptions, prepare
from .run import run


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup,
                   grad_group: dist.ProcessGroup | None = None, **options: Unpack[RingOptions]) -> Tensor:
    """Exact attention over the whole sequence from sequence shards, K/V travelling around a ring.

    ``q [B, S_local, H, D]``, ``k [B, S_local, H_kv, D]``, ``v [B, S_local, H_kv, Dv]``: this
    rank's tokens, in the layout's order (see :mod:`seqpar.attention.layout`); local lengths may
    differ between ranks. ``group``: the ring's process group. ``grad_group``: a second group over
    ``group``'s ranks (same order) for the backward's dK/dV hops, so they do not queue behind K/V
    hops (:func:`seqpar.init_mesh` makes one per ring axis; :func:`seqpar.sp_attention` passes it).
    ``options``: :class:`~seqpar.attention.call.RingOptions` -- as
    :func:`seqpar.ulysses_attention`'s (``dropout`` must be 0; ``kernel`` must return the
    log-sum-exp: ``"auto"`` is ``flash_cpu`` on CPU, ``cuda_flash`` on CUDA, ``tiled`` for softcap
    and elsewhere -- all varlen, no ``S x S`` mask), plus ``comm`` and ``stats``.

    Returns a contiguous ``[B, S_local, H, Dv]``. Raises ValueError (on every rank) for
    inconsistent inputs; an exception in one rank's kernel is raised on every rank (see
    :mod:`seqpar.comm.guard`: one tiny all-gather per call and direction, or once per batch when
    ``shard`` is the batch's and autograd is on).
    """
    groups = Groups(ring=group, ring_grad=grad_group)
    return run(prepare(q, k, v, groups, options, caller="ring_attention"), q, k, v)
