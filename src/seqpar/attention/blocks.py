"""The pure parts of ring attention: which part of a block is visible, and how partial results merge.

No communication: every rank plans its blocks from the global token positions it already holds
(:class:`seqpar.attention.shard.SeqShard`), so these are plain functions with plain unit tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .spec import AttnSpec

_FAR = 1 << 62  # "unbounded" for integer position intervals


@dataclass(frozen=True)
class BlockPlan:
    """The part of a (queries x keys) block worth computing: ``rows``/``cols`` are ``(start, n)``
    of the bounding box of visible pairs; ``visible`` counts the query-key pairs causal/window allow.
    ``fused``: how one fused op call computes the trimmed block with no mask at all -- ``"full"``
    (every pair visible) or ``"causal"`` (the op's causal flag: the aligned diagonal) -- or None:
    it needs the kernel's document rectangles (padding, documents, a window or chunk that cuts it).
    Set by :func:`fused_plan`, once per batch."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    visible: int
    fused: str | None = None


def _count_in(sorted_vals: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """How many of ``sorted_vals`` lie in ``[lo, hi]``, elementwise."""
    return torch.searchsorted(sorted_vals, hi, right=True) - torch.searchsorted(sorted_vals, lo)


def _span(mask: Tensor) -> tuple[int, int]:
    idx = mask.nonzero().flatten()
    return int(idx[0]), int(idx[-1]) - int(idx[0]) + 1


def _visible_range(spec: AttnSpec, pos: Tensor, as_key: bool) -> tuple[Tensor, Tensor]:
    """``[lo, hi]`` per token: the key positions a query at ``pos`` sees, or (``as_key``) the query
    positions that see a key at ``pos``. Causal, window and chunk each allow an interval, so their
    intersection is one interval too."""
    w = spec.window if spec.window is not None else _FAR
    if spec.causal:  # q - w < k <= q
        lo, hi = (pos, pos + w - 1) if as_key else (pos - w + 1, pos)
    else:  # |q - k| < w
        lo, hi = pos - w + 1, pos + w - 1
    if spec.chunk is not None:  # same chunk: [c * chunk, c * chunk + chunk - 1]
        start = pos.div(spec.chunk, rounding_mode="floor") * spec.chunk
        lo, hi = torch.maximum(lo, start), torch.minimum(hi, start + spec.chunk - 1)
    return lo, hi


def span_reach(q_pos: Tensor, k_pos: Tensor, q_blk: Tensor, k_blk: Tensor) -> tuple[Tensor, Tensor]:
    """Which tokens of a block a bidirectional span may make visible beyond causal: ``(rows [Sq],
    cols [Sk])`` bool -- queries with a *later* key of their span (same id >= 0, same batch row)
    and keys with an *earlier* query of theirs, in any row. From ``q_pos [Sq]``, ``k_pos [Sk]``
    (global positions) and ``q_blk [B, Sq]``, ``k_blk [B, Sk]`` (span ids, -1: none). A superset of
    the span pairs' rows and columns (window, chunk, documents and padding not looked at), so a
    plan widened by it never hides a visible pair. O((Sq + Sk) log), no ``[Sq, Sk]`` mask."""
    b = q_blk.shape[0]
    rows_q = torch.arange(b).repeat_interleave(q_blk.shape[1])
    rows_k = torch.arange(b).repeat_interleave(k_blk.shape[1])
    ids = torch.cat([torch.stack([rows_q, q_blk.reshape(-1).cpu()]), torch.stack([rows_k, k_blk.reshape(-1).cpu()])],
                    dim=1)  # [2, B*Sq + B*Sk]: (row, span id) of every token
    _, inv = torch.unique(ids, dim=1, return_inverse=True)
    inv_q, inv_k = inv[:rows_q.numel()], inv[rows_q.numel():]
    n = int(inv.max()) + 1 if inv.numel() else 0
    qp, kp = q_pos.cpu().repeat(b), k_pos.cpu().repeat(b)
    first_q = torch.full((n,), _FAR, dtype=torch.long).scatter_reduce(0, inv_q, qp, "amin")  # earliest query
    last_k = torch.full((n,), -_FAR, dtype=torch.long).scatter_reduce(0, inv_k, kp, "amax")  # latest key
    q_in, k_in = q_blk.reshape(-1).cpu() >= 0, k_blk.reshape(-1).cpu() >= 0
    rows = (q_in & (qp < last_k[inv_q])).view(b, -1).any(dim=0)
    cols = (k_in & (kp > first_q[inv_k])).view(b, -1).any(dim=0)
    return rows, cols


def plan_block(spec: AttnSpec, q_pos: Tensor, k_pos: Tensor, spans: tuple[Tensor, Tensor] | None = None
               ) -> BlockPlan | None:
    """What to compute of one block, from the global positions ``q_pos [Sq]``, ``k_pos [Sk]``; None
    when causal/window/chunk hide every pair (skip it). O((Sq + Sk) log) -- no [Sq, Sk] mask is built.
    ``spans``: :func:`span_reach` of the block (causal specs): its rows and columns join the
    bounding box, so a span that makes "future" keys visible is neither skipped nor trimmed away;
    ``visible`` still counts the pairs causal/window/chunk allow (a span only adds pairs, so a
    plan whose every pair is visible stays so)."""
    nq, nk = q_pos.numel(), k_pos.numel()
    if nq == 0 or nk == 0:
        return None
    if not spec.causal and spec.window is None and spec.chunk is None:
        return BlockPlan((0, nq), (0, nk), nq * nk)
    extra = spans is not None and spec.causal and bool(spans[0].any()) and bool(spans[1].any())
    q_cnt = _count_in(k_pos.sort().values, *_visible_range(spec, q_pos, as_key=False))
    total = int(q_cnt.sum())
    if total == 0 and not extra:
        return None
    k_cnt = _count_in(q_pos.sort().values, *_visible_range(spec, k_pos, as_key=True))
    rows, cols = q_cnt > 0, k_cnt > 0
    if extra:
        rows, cols = rows | spans[0].to(rows.device), cols | spans[1].to(cols.device)
    return BlockPlan(_span(rows), _span(cols), total)


def fused_kind(spec: AttnSpec, plan: BlockPlan, q_pos: Tensor, k_pos: Tensor, spans: bool = False) -> str | None:
    """How a fused op's own flag computes ``plan``'s trimmed block of a batch without padding or
    documents, from its global positions ``q_pos [nr]``, ``k_pos [nc]`` (the plan's rows and
    columns, on the host): ``"full"`` when causal/window/chunk hide none of its pairs, ``"causal"``
    when it is the aligned diagonal (same strictly increasing positions on both sides, causal
    alone: a zigzag rank's own block), else None. ``spans``: a bidirectional span may add pairs to
    the block (:func:`span_reach`): only ``"full"`` stays exact. Pure: once per batch, with the plans."""
    (_, nr), (_, nc) = plan.rows, plan.cols
    if plan.visible == nr * nc:
        return "full"
    diagonal = (not spans and spec.causal and spec.window is None and spec.chunk is None and nr == nc
                and torch.equal(q_pos, k_pos) and bool((q_pos[1:] > q_pos[:-1]).all()))
    return "causal" if diagonal else None


def fused_plan(spec: AttnSpec, plan: BlockPlan | None, q_pos: Tensor, k_pos: Tensor, spans: bool = False
               ) -> BlockPlan | None:
    """``plan`` with :attr:`BlockPlan.fused` set from the block's untrimmed positions ``q_pos``,
    ``k_pos`` (host tensors) -- for a batch without padding or documents only (the caller's
    check: those blocks need the kernel's rectangles); ``spans`` as :func:`fused_kind`."""
    if plan is None:
        return None
    (r0, nr), (c0, nc) = plan.rows, plan.cols
    return replace(plan, fused=fused_kind(spec, plan, q_pos[r0:r0 + nr], k_pos[c0:c0 + nc], spans))


def merge_partials(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partial results over disjoint key sets.

    ``out [B, H, Sq, D]`` and ``lse [B, H, Sq]`` in the accumulation dtype (float32, float64 for
    float64 inputs); ``out_b`` may be lower precision. Rows with ``lse = -inf`` (no key seen) weigh 0.
    """
    merged, merged_lse = out.to(torch.promote_types(out.dtype, lse.dtype), copy=True), lse.clone()
    merge_into(merged, merged_lse, out_b, lse_b)
    return merged, merged_lse


def merge_into(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """:func:`merge_partials` in place: ``out``, ``lse`` (views allowed: the rows one block
    covers) become the merged result, with no temporary the size of ``out`` (but ``out_b``'s cast
    to the accumulation dtype when it is lower precision)."""
    new = torch.logaddexp(lse, lse_b)  # [B, H, Sq]
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows with no key: weights 0
    w, w_b = torch.exp(lse - safe), torch.exp(lse_b - safe)  # [B, H, Sq]
    out.mul_(w[..., None]).addcmul_(out_b.to(out.dtype), w_b[..., None])
    lse.copy_(new)


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Attention sinks as one more partial result: ``out = 0`` with ``lse = sinks[h]`` on every row,
    merged by :func:`merge_partials`. ``out [B, H, Sq, Dv]``, ``lse [B, H, Sq]`` (accumulation
    dtype), ``sinks [H]``. The result is the attention over keys and sink together; rows that saw
    no key get ``out = 0``, ``lse = sinks[h]``."""
    sink_lse = sinks.to(lse.dtype)[None, :, None].expand(lse.shape)  # [B, H, Sq]
    return merge_partials(out, lse, out.new_zeros(()).expand(out.shape), sink_lse)


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """``d sinks [H]`` from this rank's rows: ``-sum_rows exp(sink_h - lse) * rowsum(dout * out)``,
    with ``out``/``lse`` those :func:`fold_sinks` returned (the sink's softmax weight times the
    usual ``dS = P (dP - D)`` with ``dP = 0``: its value vector is zero)."""
    acc = lse.dtype
    weight = torch.exp(sinks.to(acc)[None, :, None] - lse)  # [B, H, Sq]
    d = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # [B, H, Sq]
    return -(weight * d).sum(dim=(0, 2)).to(sinks.dtype)


def merged_block_grads(block: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]], dout: Tensor, q: Tensor,
                       k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one block merged into a row's ``out``/``lse``, for a kernel that has
    autograd but no backward taking a given ``out`` and ``lse``: recompute the block's
    ``(out_b, lse_b) = block(q, k, v)`` with autograd and pull the merged output's gradient back
    through both. With ``w_b = exp(lse_b - lse)``, ``out = sum_b w_b out_b`` and
    ``lse = logsumexp_b lse_b``, so ``dL/d out_b = w_b dout`` and
    ``dL/d lse_b = w_b * rowsum(dout * (out_b - out))``. Rows that see no key in the block
    (``lse_b = -inf``) or anywhere (``lse = -inf``) weigh 0. Costs one more forward of the block."""
    with torch.enable_grad():
        ins = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out_b, lse_b = block(*ins)
        acc = lse.dtype
        seen = torch.isfinite(lse) & torch.isfinite(lse_b.detach())  # [B, H, Sq]
        w = torch.where(seen, torch.exp(lse_b.detach().to(acc) - torch.where(seen, lse, 0.0)), 0.0)
        d_out = (dout.to(acc) * w[..., None]).to(out_b.dtype)
        d_lse = w * (dout.to(acc) * (out_b.detach().to(acc) - out.to(acc))).sum(dim=-1)
        grads = torch.autograd.grad((out_b, lse_b), ins, (d_out, d_lse.to(lse_b.dtype)), allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, (q, k, v), strict=True))


@dataclass
class RingStats:
    """Attention work one rank did (filled by the forward): blocks computed / skipped, the query-key
    pairs causal/window allow in them, the pairs the kernel was given (trimmed rectangles), and
    how each computed block ran (``ops``: ``"fused full"`` / ``"fused causal"`` -- one fused op
    call, no mask -- or ``"rectangles"``: the kernel's document rectangles), counted."""

    blocks: int = 0
    skipped: int = 0
    visible_pairs: int = 0
    computed_pairs: int = 0
    ops: dict[str, int] = field(default_factory=dict)

    def add(self, plan: BlockPlan) -> None:
        """Count one computed block of ``plan``."""
        self.blocks += 1
        self.visible_pairs += plan.visible
        self.computed_pairs += plan.rows[1] * plan.cols[1]
        how = "rectangles" if plan.fused is None else f"fused {plan.fused}"
        self.ops[how] = self.ops.get(how, 0) + 1
