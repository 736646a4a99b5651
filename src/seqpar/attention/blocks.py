"""The pure parts of ring attention: which part of a block is visible, and how partial results merge.

No communication: every rank plans its blocks from the global token positions it already holds
(:class:`seqpar.attention.shard.SeqShard`), so these are plain functions with plain unit tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .spec import AttnSpec

_FAR = 1 << 62  # "unbounded" for integer position intervals


@dataclass(frozen=True)
class BlockPlan:
    """The part of a (queries x keys) block worth computing: ``rows``/``cols`` are ``(start, n)``
    of the bounding box of visible pairs; ``visible`` counts the query-key pairs causal/window allow."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    visible: int


def _count_in(sorted_vals: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """How many of ``sorted_vals`` lie in ``[lo, hi]``, elementwise."""
    return torch.searchsorted(sorted_vals, hi, right=True) - torch.searchsorted(sorted_vals, lo)


def _span(mask: Tensor) -> tuple[int, int]:
    idx = mask.nonzero().flatten()
    return int(idx[0]), int(idx[-1]) - int(idx[0]) + 1


def plan_block(spec: AttnSpec, q_pos: Tensor, k_pos: Tensor) -> BlockPlan | None:
    """What to compute of one block, from the global positions ``q_pos [Sq]``, ``k_pos [Sk]``; None
    when causal/window hide every pair (skip it). O((Sq + Sk) log) -- no [Sq, Sk] mask is built."""
    nq, nk = q_pos.numel(), k_pos.numel()
    if nq == 0 or nk == 0:
        return None
    if not spec.causal and spec.window is None:
        return BlockPlan((0, nq), (0, nk), nq * nk)
    w = spec.window if spec.window is not None else _FAR
    # a query at q sees keys in [q - w + 1, q] (causal) or [q - w + 1, q + w - 1] (window only);
    # mirrored, a key at k is seen by queries in [k, k + w - 1] or [k - w + 1, k + w - 1]
    ahead = 0 if spec.causal else w - 1
    q_cnt = _count_in(k_pos.sort().values, q_pos - w + 1, q_pos + ahead)
    total = int(q_cnt.sum())
    if total == 0:
        return None
    k_cnt = _count_in(q_pos.sort().values, k_pos - ahead, k_pos + w - 1)
    return BlockPlan(_span(q_cnt > 0), _span(k_cnt > 0), total)


def merge_partials(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partial results over disjoint key sets.

    ``out [B, H, Sq, D]`` and ``lse [B, H, Sq]`` in the accumulation dtype (float32, float64 for
    float64 inputs); ``out_b`` may be lower precision. Rows with ``lse = -inf`` (no key seen) weigh 0.
    """
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w, w_b = torch.exp(lse - safe), torch.exp(lse_b - safe)  # [B, H, Sq]
    return out * w[..., None] + out_b.to(out.dtype) * w_b[..., None], new


@dataclass
class RingStats:
    """Attention work one rank did (filled by the forward): blocks computed / skipped, the query-key
    pairs causal/window allow in them, and the pairs the kernel was given (trimmed rectangles)."""

    blocks: int = 0
    skipped: int = 0
    visible_pairs: int = 0
    computed_pairs: int = 0
