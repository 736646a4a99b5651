"""Ulysses' exchange: which query and KV heads each rank computes, and the two all-to-alls that trade
a sequence shard with all heads for the whole sequence with a share of the heads::

    q, k, v   # [B, S/P, H, D], [B, S/P, H_kv, D]     sequence shard, all heads
      | heads_to_seq: one fused all-to-all of q, k, v (scatter heads, gather sequence)
    q, k, v   # [B, S, H/P, D], [B, S, H_kv', D]      whole sequence, this rank's heads
      | (local attention: seqpar.attention.run)
    out       # [B, S, H/P, Dv]
      | seq_to_heads: all-to-all (scatter sequence, gather heads)
    out       # [B, S/P, H, Dv]

Rank r computes query heads ``tensor_split(range(H), P)[r]`` and receives exactly the KV heads
those heads use, so ``H % P != 0`` and ``H_kv < P`` (KV heads replicated to several ranks, their
gradients summed back by the all-to-all's backward) need no special case. Attention sinks ``[H]``
are sliced to the same query heads (a differentiable slice: each rank's gradient covers its heads).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import Flag, all_to_all_multi, even_ranges, split_offsets
from .spec import AttnSpec


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
    the index tensor is made once per device and pattern (a bounded memo), not per layer."""
    idx = _kv_positions(q_range, kv_range, group)
    return None if idx is None else _index_tensor(idx, device)


@functools.lru_cache(maxsize=256)
def _kv_positions(q_range: tuple[int, int], kv_range: tuple[int, int], group: int) -> tuple[int, ...] | None:
    start, n = q_range
    idx = tuple((start + j) // group - kv_range[0] for j in range(n))
    n_kv = kv_range[1]
    if n_kv and n % n_kv == 0 and idx == tuple(j // (n // n_kv) for j in range(n)):
        return None
    return idx


@functools.lru_cache(maxsize=64)
def _index_tensor(idx: tuple[int, ...], device: torch.device | None) -> Tensor:
    """``idx`` as a long tensor on ``device``: a model's layers all ask for the same few."""
    return torch.tensor(idx, device=device)


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
