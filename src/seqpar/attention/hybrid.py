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

from dataclasses import replace

import torch.distributed as dist
from torch import Tensor

from ..comm.agree import share
from ..comm.guard import Guard
from .blocks import RingStats
from .kernels import KernelArg
from .ring import check_grad_group, resolve_shard, ring_options, run_ring
from .shard import SeqShard, deferred_check, gather_global_masks, shard_cache
from .spec import AttnSpec, check_supported
from .ulysses import heads_to_seq, idle_output, local_heads, seq_to_heads
from .validate import check_attention_inputs


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


def hybrid_attention(
    q: Tensor, k: Tensor, v: Tensor, *, ulysses_group: dist.ProcessGroup, ring_group: dist.ProcessGroup,
    causal: bool = False, scale: float | None = None, window: int | None = None, softcap: float | None = None,
    chunk: int | None = None, sinks: Tensor | None = None, dropout: float = 0.0, kernel: KernelArg | None = None,
    key_padding_mask: Tensor | None = None, segment_ids: Tensor | None = None, shard: SeqShard | None = None,
    layout: str | None = None, comm: str = "p2p", validate: bool = True, stats: RingStats | None = None,
    ring_grad_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Exact attention over the whole sequence: Ulysses inside ``ulysses_group``, ring over ``ring_group``.

    Layouts and options as :func:`seqpar.ring_attention` (``ring_grad_group``: its ``grad_group``);
    ``shard`` and ``layout`` describe the ``R * U`` sp ranks in ring-major order
    (:func:`seqpar.attention.layout.layout_indices` with ``ulysses=U``).
    Returns a contiguous ``[B, S_local, H, Dv]``. Raises ValueError on every rank for inconsistent
    inputs; an exception in one rank's kernel is raised on every rank of the grid.
    """
    spec = AttnSpec(causal=causal, scale=scale, window=window, softcap=softcap, chunk=chunk, sinks=sinks)
    kern = ring_options(q, spec, kernel=kernel, dropout=dropout, comm=comm, shard=shard,
                        masks_given=key_padding_mask is not None or segment_ids is not None)
    check_grad_group(ring_group, ring_grad_group)
    n_u, n_r = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    u, r = dist.get_rank(ulysses_group), dist.get_rank(ring_group)
    if shard is not None and len(shard.seq_lens) != n_u * n_r:
        raise ValueError(f"the SeqShard has {len(shard.seq_lens)} shard lengths for ulysses={n_u} x ring={n_r}"
                         f" = {n_u * n_r} ranks: build it over the sp axis of this mesh")
    if validate:
        seq_lens = _check_inputs(q, k, v, ulysses_group, ring_group, spec, key_padding_mask, segment_ids,
                                 None if shard is None else shard.seq_lens[r * n_u + u])
    else:
        seq_lens = shard.seq_lens if shard is not None else (q.shape[1],) * (n_u * n_r)
    check_supported(kern, spec)  # after the cross-rank check: the spec is the same everywhere now
    sp_shard = resolve_shard(shard, tuple(seq_lens), layout, n_r, ulysses=n_u)
    my_lens = list(sp_shard.seq_lens[r * n_u:(r + 1) * n_u])
    ring_lens = tuple(sum(sp_shard.seq_lens[i * n_u:(i + 1) * n_u]) for i in range(n_r))
    keep, seg = sp_shard.key_keep, sp_shard.segments
    if key_padding_mask is not None or segment_ids is not None:
        # the ring chunk inside the ulysses group, then the chunks over the ring (ring-major = layout order)
        keep, seg = gather_global_masks(key_padding_mask, segment_ids, [(ulysses_group, my_lens),
                                                                         (ring_group, ring_lens)])
    # the ring sees R ranks holding whole ring chunks; the layout permutation is the same one
    if key_padding_mask is None and segment_ids is None:  # a batch's shard: one ring shard per batch
        ring_shard = shard_cache(sp_shard).setdefault(("ring shard", ring_lens),
                                                      SeqShard(ring_lens, sp_shard.positions, keep, seg))
    else:
        ring_shard = SeqShard(ring_lens, sp_shard.positions, keep, seg)

    guard = Guard([ulysses_group, ring_group], "hybrid attention", batch=deferred_check(shard, q, k, v, sinks))
    q, k, v, sinks = guard.inputs(q, k, v, sinks)
    qh, kh, vh, q_ranges = heads_to_seq(q, k, v, group=ulysses_group, seq_lens=my_lens)  # [B, S/R, H/U, D]
    if q_ranges[u][1] == 0:  # more ulysses ranks than query heads: this ring group has nothing to do
        out = idle_output(qh, kh, vh, sinks)
    else:
        out = run_ring(qh, kh, vh, group=ring_group, spec=local_heads(replace(spec, sinks=sinks), q_ranges[u]),
                       kernel=kern, shard=ring_shard, comm=comm, stats=stats, guard=guard,
                       grad_group=ring_grad_group)  # [B, S/R, H/U, Dv]
    out = seq_to_heads(out, group=ulysses_group, seq_lens=my_lens, q_ranges=q_ranges)  # [B, S/(R*U), H, Dv]
    guard.fence("forward")
    return out


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, ulysses_group: dist.ProcessGroup,
                  ring_group: dist.ProcessGroup, spec: AttnSpec, key_padding_mask: Tensor | None,
                  segment_ids: Tensor | None, shard_len: int | None) -> tuple[int, ...]:
    """Validate over the whole ``ring x ulysses`` grid so every rank raises the same ValueError.

    1. Each ulysses group checks its ranks' inputs (one all-gather); an error is kept, not raised.
    2. The ring group shares every ulysses group's verdict, lengths and message (one all-gather):
       every rank sees the same table and raises the same error if any group failed.
    3. All inputs are well-formed now; the ring group checks that the groups agree (same heads,
       dtype, options), which every ring group sees alike. Returns all sp ranks' local lengths.
    """
    kw = dict(spec=spec, key_padding_mask=key_padding_mask, segment_ids=segment_ids, shard_len=shard_len)
    n_u = dist.get_world_size(ulysses_group)
    try:
        lens, err = check_attention_inputs(q, k, v, group=ulysses_group, **kw), None
    except ValueError as e:
        lens, err = (0,) * n_u, str(e)
    table = share({f"len{i}": float(n) for i, n in enumerate(lens)}, ring_group, problem=err, device=q.device)
    if any(table.problems):
        raise ValueError("\n".join(f"in the ulysses group of ring rank {i}: {m}"
                                   for i, m in enumerate(table.problems) if m))
    try:
        check_attention_inputs(q, k, v, group=ring_group, **kw)
    except ValueError as e:
        raise ValueError(f"{e}\n  (ranks counted along the ring axis: ring rank i holds sp ranks"
                         f" {n_u}*i .. {n_u}*i+{n_u - 1})") from None
    return tuple(int(n) for row in table.rows for n in row.values())
