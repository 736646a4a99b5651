"""Hybrid Ulysses x ring attention: Ulysses all-to-all inside a ulysses group, ring across groups.

Ranks form a ``ring x ulysses`` grid (``sp_rank = ring_idx * U + ulysses_idx``, as in
:func:`seqpar.init_mesh`). The U ranks of one ring step hold consecutive pieces of the layout, so
their all-to-all yields one whole ring chunk for a subset of heads; the R ranks that share a
ulysses index (hence the same heads) then run the ring on it::

    q, k, v   # [B, S/(R*U), H, D]      sp shard, all heads
      | all-to-all over the ulysses group (scatter heads, gather sequence)
    q, k, v   # [B, S/R, H/U, D]        this ring rank's chunk, this ulysses rank's heads
      | ring attention over the ring group (K/V chunks travel)
    out       # [B, S/R, H/U, D]
      | all-to-all back
    out       # [B, S/(R*U), H, D]

Ulysses is capped by the head count and moves activations once; the ring has no cap but moves K/V
P-1 times: keep ulysses inside a node and the ring across nodes.

Attention sinks follow the heads (sliced to this ulysses rank's query heads, then folded in by
the ring). The local compute runs under one :class:`~seqpar.comm.guard.Guard` for the whole
call, fenced over the ulysses group and then the ring, so a rank whose kernel raises stops every
rank of the grid: per call (two tiny all-gathers per direction), or once per batch for a batch's
SeqShard under autograd (see :mod:`seqpar.comm.guard`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from typing_extensions import Unpack

from .call import Groups, RingOptions, prepare
from .run import run


def hybrid_groups(group: dist.ProcessGroup, ulysses: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's ``(ulysses_group, ring_group)`` when ``group``'s ranks form a ``ring x ulysses`` grid
    (ring-major). Collective over the default group (``dist.new_group``): every process calls it.
    Prefer ``seqpar.init_mesh(sp=..., ulysses=..., ring=...)``, which builds the same axes."""
    ranks = dist.get_process_group_ranks(group)
    if ulysses < 1 or len(ranks) % ulysses:
        raise ValueError(f"ulysses={ulysses} must divide the group size {len(ranks)}")
    ring = len(ranks) // ulysses
    me = dist.get_rank()
    mine = []
    for members in [ranks[i * ulysses:(i + 1) * ulysses] for i in range(ring)] + [ranks[j::ulysses]
                                                                                    for j in range(ulysses)]:
        pg = dist.new_group(members)
        if me in members:
            mine.append(pg)
    return mine[0], mine[1]


def hybrid_attention(q: Tensor, k: Tensor, v: Tensor, *, ulysses_group: dist.ProcessGroup,
                     ring_group: dist.ProcessGroup, ring_grad_group: dist.ProcessGroup | None = None,
                     **options: Unpack[RingOptions]) -> Tensor:
    """Exact attention over the whole sequence: Ulysses inside ``ulysses_group``, ring over ``ring_group``.

    Layouts and options as :func:`seqpar.ring_attention` (``ring_grad_group``: its ``grad_group``);
    ``shard`` and ``layout`` describe the ``R * U`` sp ranks in ring-major order
    (:func:`seqpar.attention.layout.layout_indices` with ``ulysses=U``).
    Returns a contiguous ``[B, S_local, H, Dv]``. Raises ValueError on every rank for inconsistent
    inputs; an exception in one rank's kernel is raised on every rank of the grid.
    """
    groups = Groups(ulysses=ulysses_group, ring=ring_group, ring_grad=ring_grad_group)
    return run(prepare(q, k, v, groups, options, caller="hybrid_attention"), q, k, v)
