"""Ulysses (DeepSpeed-Ulysses style) sequence-parallel attention.

Each rank holds a shard of the sequence with all heads. One fused all-to-all trades it for the
whole sequence with a subset of heads, any local kernel attends, and one all-to-all trades back::

    q, k, v   # [B, S/P, H, D], [B, S/P, H_kv, D]      sequence shard, all heads
      | all-to-all (q, k, v fused): scatter heads, gather sequence
    q, k, v   # [B, S, H/P, D], [B, S, H_kv', D]       whole sequence, this rank's heads
      | local kernel
    out       # [B, S, H/P, D]
      | all-to-all: scatter sequence, gather heads
    out       # [B, S/P, H, D]

Rank r computes query heads ``tensor_split(range(H), P)[r]`` and receives exactly the KV heads
those heads use, so ``H % P != 0`` and ``H_kv < P`` (KV heads replicated to several ranks, their
gradients summed back by the all-to-all's backward) need no special case. Attention sinks ``[H]``
are sliced to the same query heads (a differentiable slice: each rank's gradient covers its heads).

The local kernel runs under a :class:`~seqpar.comm.guard.Guard`: a rank whose kernel raises sends
zeros through the output all-to-all (and zero gradients through the backward one), and every rank
raises at the fence that ends the call in each direction -- or, for a batch's SeqShard under
autograd, at the batch's check (:mod:`seqpar.comm.guard`).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import Flag, all_to_all_multi, even_ranges, split_offsets
from ..comm.guard import Guard
from .kernels import KernelArg, attend, get_kernel
from .shard import SeqShard, deferred_check, with_global_masks
from .spec import AttnSpec, Kernel, MaskInfo, check_supported
from .validate import shard_lengths


def head_ranges(n_heads: int, n_kv_heads: int, parts: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Query-head and KV-head ``(start, length)`` of each rank. KV ranges may overlap (GQA with
    ``H_kv < P``): a rank gets every KV head one of its query heads reads."""
    group = n_heads // n_kv_heads
    q_ranges = even_ranges(n_heads, parts)
    kv_ranges = []
    for start, n in q_ranges:
        if n == 0:
            kv_ranges.append((0, 0))
            continue
        lo, hi = start // group, (start + n - 1) // group + 1
        kv_ranges.append((lo, hi - lo))
    return q_ranges, kv_ranges


def kv_index(q_range: tuple[int, int], kv_range: tuple[int, int], group: int,
             device: torch.device | None = None) -> Tensor | None:
    """For a rank's query heads, which of its received KV heads each one reads; None when the
    plain ``repeat_interleave`` pattern of GQA kernels already matches. Pure arithmetic on ints;
    the index tensor is made once per device and shape, not per layer."""
    idx = _kv_positions(q_range, kv_range, group)
    if idx is None:
        return None
    key = (idx, device)
    if key not in _KV_INDEX:
        _KV_INDEX[key] = torch.tensor(idx, device=device)
    return _KV_INDEX[key]


_KV_INDEX: dict[tuple, Tensor] = {}


@functools.lru_cache(maxsize=256)
def _kv_positions(q_range: tuple[int, int], kv_range: tuple[int, int], group: int) -> tuple[int, ...] | None:
    start, n = q_range
    idx = tuple((start + j) // group - kv_range[0] for j in range(n))
    n_kv = kv_range[1]
    if n_kv and n % n_kv == 0 and idx == tuple(j // (n // n_kv) for j in range(n)):
        return None
    return idx


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, causal: bool = False,
    scale: float | None = None, window: int | None = None, softcap: float | None = None,
    chunk: int | None = None, sinks: Tensor | None = None,
    dropout: float = 0.0, kernel: KernelArg | None = None,
    key_padding_mask: Tensor | None = None, segment_ids: Tensor | None = None,
    shard: SeqShard | None = None, validate: bool = True,
) -> Tensor:
    """Exact attention over the whole sequence from sequence shards, via two all-to-alls.

    Args:
        q: ``[B, S_local, H, D]``; k: ``[B, S_local, H_kv, D]``; v: ``[B, S_local, H_kv, Dv]`` --
            this rank's tokens. Local lengths may differ between ranks (any split; tensor_split's
            is the usual one).
        group: the sequence-parallel process group (``mesh.get_group("sp")``).
        causal, scale, window, chunk, softcap, dropout: see :class:`seqpar.attention.spec.AttnSpec`.
        sinks: ``[H]`` attention-sink logits (GPT-OSS), the same on every rank; may require grad:
            each rank's gradient covers its own heads, so their sum over the group is the total.
        kernel: the local kernel: ``"auto"`` (default: ``sdpa`` where its causal flag suffices,
            else the device's varlen lse kernel -- see :mod:`seqpar.attention.kernels`), any other
            name there, a Kernel object or a callable ``fn(q, k, v, *, spec, mask) -> out`` in the
            ``[B, H, S, D]`` layout.
        key_padding_mask, segment_ids: this rank's ``[B, S_local]`` padding mask (True = real
            token) and packed-document ids; gathered with one small collective. Pass ``shard``
            instead to reuse batch-level global ones at no cost.
        shard: batch-level :class:`SeqShard` (lengths, positions, global mask and segments).
        validate: check shapes/dtypes/options across ranks first (one small all-gather). With
            ``validate=False`` the caller vouches for them and ``shard`` gives the lengths
            (without it all ranks are assumed to hold ``S_local`` tokens).

    Returns a contiguous ``[B, S_local, H, Dv]``. Raises ValueError on every rank for inconsistent
    inputs; an exception in one rank's kernel is raised on every rank (see :mod:`seqpar.comm.guard`:
    checked per call, or once per batch when ``shard`` is the batch's and autograd is on).
    """
    spec = AttnSpec(causal=causal, scale=scale, window=window, softcap=softcap, dropout=dropout, chunk=chunk,
                    sinks=sinks)
    kern = get_kernel("auto" if kernel is None else kernel)
    if shard is not None and (key_padding_mask is not None or segment_ids is not None):
        raise ValueError("pass the padding mask and segment ids either in the SeqShard or as arguments, not both")

    seq_lens = shard_lengths(q, k, v, group=group, spec=spec, key_padding_mask=key_padding_mask,
                             segment_ids=segment_ids, shard=shard, validate=validate)
    check_supported(kern, spec)  # after the cross-rank check: the spec is now known to be the same everywhere
    batch = deferred_check(shard, q, k, v, sinks)
    if shard is None:
        shard = SeqShard(seq_lens)
        shard = with_global_masks(shard, key_padding_mask, segment_ids, group)
    return _ulysses(q, k, v, group=group, spec=spec, kernel=kern, shard=shard, batch=batch)


def heads_to_seq(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, seq_lens: list[int],
                 flag: Flag | None = None) -> tuple[Tensor, Tensor, Tensor, list[tuple[int, int]]]:
    """The first all-to-all: ``[B, S/P, H, D] -> [B, S, H/P, D]`` for q, k, v in one exchange.

    Returns ``(q, k, v, q_ranges)``: this rank's query heads with the KV heads they read (one copy
    per query head where the GQA grouping does not line up with the split), and every rank's
    query-head range for :func:`seq_to_heads`. Backward: the reverse all-to-all, which carries
    ``flag`` (a :meth:`~seqpar.comm.guard.Guard.flag` of the backward) when given.
    """
    p, me = dist.get_world_size(group), dist.get_rank(group)
    n_heads, n_kv = q.shape[2], k.shape[2]
    q_ranges, kv_ranges = head_ranges(n_heads, n_kv, p)
    qh, kh, vh = all_to_all_multi(
        [q, k, v], scatter_dim=2, gather_dim=1, group=group,
        send_ranges=[q_ranges, kv_ranges, kv_ranges], recv_sizes=[seq_lens] * 3, flag=flag)
    if q_ranges[me][1]:
        idx = kv_index(q_ranges[me], kv_ranges[me], n_heads // n_kv, kh.device)
        if idx is not None:  # uneven GQA split: give each query head its own copy of its KV head
            kh, vh = kh.index_select(2, idx), vh.index_select(2, idx)
    return qh, kh, vh, q_ranges


def seq_to_heads(out: Tensor, *, group: dist.ProcessGroup, seq_lens: list[int],
                 q_ranges: list[tuple[int, int]], flag: Flag | None = None) -> Tensor:
    """The second all-to-all: ``[B, S, H/P, D] -> [B, S/P, H, D]`` (contiguous), carrying ``flag``
    (a :meth:`~seqpar.comm.guard.Guard.flag` of the forward) when given. Backward: the reverse."""
    seq_ranges = list(zip(split_offsets(seq_lens), seq_lens, strict=True))
    head_counts = [n for _, n in q_ranges]
    return all_to_all_multi([out], scatter_dim=1, gather_dim=2, group=group,
                            send_ranges=[seq_ranges], recv_sizes=[head_counts], flag=flag)[0]


def local_heads(spec: AttnSpec, q_range: tuple[int, int]) -> AttnSpec:
    """``spec`` for this rank's query heads: sinks ``[H] -> [H/P]`` (a differentiable slice)."""
    if spec.sinks is None:
        return spec
    start, n = q_range
    return replace(spec, sinks=spec.sinks[start:start + n])


def idle_output(qh: Tensor, kh: Tensor, vh: Tensor, sinks: Tensor | None = None) -> Tensor:
    """The output ``[B, S, 0, Dv]`` of a rank that got no query heads (more ranks than heads). It
    still depends on the received q, k, v, so autograd runs this rank's part of the backward
    all-to-all, which its peers wait for (and gives ``sinks`` a zero gradient, not none)."""
    out = qh.new_zeros(qh.shape[:3] + (vh.shape[3],)) + 0 * qh.sum() + 0 * kh.sum() + 0 * vh.sum()
    return out if sinks is None else out + 0 * sinks.sum().to(out.dtype)


def _ulysses(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, spec: AttnSpec, kernel: Kernel,
             shard: SeqShard, batch: object | None) -> Tensor:
    me = dist.get_rank(group)
    seq_lens = list(shard.seq_lens)
    guard = Guard([group], "ulysses attention", batch=batch)
    q, k, v, sinks = guard.inputs(q, k, v, spec.sinks)
    # Checked per call, the guard's flags ride the call's last all-to-all in each direction: no
    # fence collective unless a rank failed. Checked once per batch: no flag (None), nothing read.
    qh, kh, vh, q_ranges = heads_to_seq(q, k, v, group=group, seq_lens=seq_lens,
                                        flag=guard.flag("backward"))  # [B, S, H/P, D]

    if q_ranges[me][1] == 0:  # more ranks than query heads: nothing to compute here
        out = idle_output(qh, kh, vh, sinks)
    else:
        info = MaskInfo(q_pos=shard.positions, k_pos=shard.positions, key_keep=shard.key_keep,
                        q_seg=shard.segments, k_seg=shard.segments)
        local = local_heads(replace(spec, sinks=sinks), q_ranges[me])
        out = attend(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), local, info, kernel, guard)
        out = out.transpose(1, 2)  # [B, S, H/P, Dv]

    out = seq_to_heads(out, group=group, seq_lens=seq_lens, q_ranges=q_ranges,
                       flag=guard.flag("forward"))  # [B, S/P, H, Dv]
    guard.fence("forward")
    return out
