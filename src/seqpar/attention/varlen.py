"""Padded and packed blocks as document rectangles: no ``[B, 1, Sq, Sk]`` mask, work where keys are seen.

A block whose rows hold packed documents (segment ids) or padding (a key mask) is mostly invisible:
a query sees only keys of its own document. :func:`document_rects` cuts such a block into the
rectangles ``(row, query run, key run)`` of one document each -- runs of equal document id in the
block's token order, padding keys dropped -- and trims each to what causal / window / chunk let
its queries see (:func:`seqpar.attention.blocks.plan_block` on the run's global positions)::

    keys ->   d0 d0 d0 | d1 d1 | pad            one row, causal
    q  d0     [ causal ]                        rectangle (d0 x d0): the kernel's causal flag
       d1               [causal]                rectangle (d1 x d1)
       (d0 x d1, d1 x d0, anything x pad: never computed)

Each rectangle says how the kernel should mask it: not at all (every pair visible), with its
causal flag (an aligned diagonal), or with a position mask of the rectangle's own size -- at most
one document by one document, never the block. Rectangles are also cut into tiles of at most
``tile x tile`` (:data:`TILE`), so no kernel call -- forward or backward -- holds more than a
tile's worth of scores, whatever the block's length. Pure: no communication, plain unit tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
from torch import Tensor

from .blocks import plan_block, span_reach
from .spec import AttnSpec, MaskInfo, dense_mask

T = TypeVar("T")

TILE = 1024
"""The longest query or key run one kernel call gets (the CPU op's backward keeps a buffer that
grows with the product of both)."""


@dataclass(frozen=True)
class Rect:
    """One document's part of a block: batch ``row`` (None: every row, when no row has padding or
    documents), query rows ``q = (start, n)`` and key columns ``k = (start, n)`` in the block's own
    token order, and how to mask it: ``"none"`` (all visible),
    ``"causal"`` (the kernel's causal flag: same positions on both sides, increasing) or
    ``"positions"`` (a ``[n_q, n_k]`` mask from the positions). ``spans``: a bidirectional span
    may make pairs of it visible that causal hides (:func:`~seqpar.attention.blocks.span_reach`):
    its ``"positions"`` mask reads the row's span ids too."""

    row: int | None
    q: tuple[int, int]
    k: tuple[int, int]
    how: str
    spans: bool = False


def _runs(ids: Tensor, pos: Tensor | None = None) -> list[tuple[int, int, int]]:
    """``(value, start, length)`` of each run of equal values in a 1-D tensor -- and, given
    ``pos``, of consecutive positions too (a permuted layout's pieces: a rectangle between two
    pieces is then exactly visible or causal, not a bounding box of scattered pairs)."""
    n = ids.numel()
    if n == 0:
        return []
    cut = ids[1:] != ids[:-1]
    if pos is not None:
        cut |= pos[1:] != pos[:-1] + 1
    cuts = cut.nonzero().flatten().add(1).tolist()
    starts, ends = [0, *cuts], [*cuts, n]
    values = ids[starts].tolist()
    return [(v, s, e - s) for v, s, e in zip(values, starts, ends, strict=True)]


def _consecutive(pos: Tensor) -> bool:
    return pos.numel() <= 1 or bool((pos[1:] - pos[:-1] == 1).all())


def _how(spec: AttnSpec, q_pos: Tensor, k_pos: Tensor, visible: int) -> str:
    if visible == q_pos.numel() * k_pos.numel():
        return "none"
    if (spec.causal and spec.window is None and spec.chunk is None and q_pos.numel() == k_pos.numel()
            and _consecutive(q_pos) and bool(q_pos[0] == k_pos[0]) and _consecutive(k_pos)):
        return "causal"
    return "positions"


def _tiles(spec: AttnSpec, row: int | None, q_pos: Tensor, k_pos: Tensor, q0: int, nq: int, k0: int, nk: int,
           tile: int, blk: tuple[Tensor, Tensor] | None = None) -> list[Rect]:
    """The visible tiles of one run-by-run rectangle, each trimmed to what its queries see;
    ``blk``: the row's span ids ``(q_blk [Sq], k_blk [Sk])`` (causal specs with spans only)."""
    out = []
    for a in range(q0, q0 + nq, tile):
        na = min(tile, q0 + nq - a)
        for c in range(k0, k0 + nk, tile):
            nc_ = min(tile, k0 + nk - c)
            reach = None if blk is None else span_reach(q_pos[a:a + na], k_pos[c:c + nc_], blk[0][None, a:a + na],
                                                        blk[1][None, c:c + nc_])
            spans = reach is not None and bool(reach[0].any()) and bool(reach[1].any())
            plan = plan_block(spec, q_pos[a:a + na], k_pos[c:c + nc_], reach if spans else None)
            if plan is None:
                continue
            (r0, nr), (c0, nc) = plan.rows, plan.cols
            how = _how(spec, q_pos[a + r0:a + r0 + nr], k_pos[c + c0:c + c0 + nc], plan.visible)
            spans = spans and how != "none"  # every pair visible already: nothing for a span to add
            out.append(Rect(row, (a + r0, nr), (c + c0, nc), "positions" if spans else how, spans))
    return out


_PLAIN: dict[tuple, Any] = {}
"""Results for masks without tensors, by key alone (pure ints and flags): a bounded memo."""


def per_batch(mask: MaskInfo, key: tuple, compute: Callable[[], T]) -> T:
    """``compute()``, once per batch: kept in ``mask.plans`` (the part of the batch's
    :class:`~seqpar.attention.shard.BatchState` the mask describes, which lives as long as the
    batch's SeqShard) and read back by the batch's later layers and the backward -- without
    touching the tensors, so no host synchronization after a batch's first layer. A mask without
    tensors (positions 0..n-1, nothing masked) is a pure function of ``key``: computed once per
    process (a bounded memo), not per layer. A mask with tensors but no ``plans`` (built outside
    a batch's SeqShard) is planned per call."""
    if all(t is None for t in mask.tensors()):
        if key not in _PLAIN:
            if len(_PLAIN) >= 1024:  # sizes vary from batch to batch: keep the memo bounded
                _PLAIN.clear()
            _PLAIN[key] = compute()
        return _PLAIN[key]
    if mask.plans is None:
        return compute()
    if key not in mask.plans:
        mask.plans[key] = compute()
    return mask.plans[key]


def document_rects(spec: AttnSpec, mask: MaskInfo | None, sq: int, sk: int, batch: int,
                   tile: int = TILE) -> list[Rect]:
    """The rectangles of a ``(queries x keys)`` block that something sees (see the module doc),
    tiled to at most ``tile x tile``. Tensors of ``mask`` may live on any device. Planned once
    per batch (:func:`per_batch`)."""
    mask = mask or MaskInfo()
    return per_batch(mask, ("rects", spec.causal, spec.window, spec.chunk, sq, sk, batch, tile),
                     lambda: _document_rects(spec, mask, sq, sk, batch, tile))


def _document_rects(spec: AttnSpec, mask: MaskInfo, sq: int, sk: int, batch: int, tile: int) -> list[Rect]:
    cpu = torch.device("cpu")
    q_pos, k_pos = (p.to(cpu) for p in mask.positions(sq, sk, cpu))
    positional = spec.causal or spec.window is not None or spec.chunk is not None
    q_cut, k_cut = (q_pos, k_pos) if positional else (None, None)  # pieces of a permuted layout
    rows: list[int | None] = [None] if mask.is_trivial() else list(range(batch))  # trivial: rows alike
    out = []
    for row in rows:
        q_doc = mask.q_seg[row].to(cpu) if mask.q_seg is not None else torch.zeros(sq, dtype=torch.long)
        k_doc = mask.k_seg[row].to(cpu) if mask.k_seg is not None else torch.zeros(sk, dtype=torch.long)
        if mask.key_keep is not None:  # a padding key is in no document
            k_doc = torch.where(mask.key_keep[row].to(cpu), k_doc, torch.full_like(k_doc, -(1 << 40)))
        blk = None
        if spec.causal and mask.spans and row is not None:  # spans widen causal only
            blk = (mask.q_blk[row].to(cpu), mask.k_blk[row].to(cpu))
        key_runs: dict[int, list[tuple[int, int]]] = {}
        for doc, start, n in _runs(k_doc, k_cut):
            key_runs.setdefault(doc, []).append((start, n))
        for doc, q0, nq in _runs(q_doc, q_cut):
            for k0, nk in key_runs.get(doc, ()):
                out += _tiles(spec, row, q_pos, k_pos, q0, nq, k0, nk, tile, blk)
    return out


def _without_whole_chunk(spec: AttnSpec, q_pos: Tensor, k_pos: Tensor) -> AttnSpec:
    """``spec`` without ``chunk`` when all of ``q_pos`` and ``k_pos`` fall in one chunk."""
    if spec.chunk is None or q_pos.numel() == 0 or k_pos.numel() == 0:
        return spec
    lo = min(int(q_pos.min()), int(k_pos.min())) // spec.chunk
    hi = max(int(q_pos.max()), int(k_pos.max())) // spec.chunk
    return replace(spec, chunk=None) if lo == hi else spec


def _without_wide_window(spec: AttnSpec, q_pos: Tensor, k_pos: Tensor) -> AttnSpec:
    """``spec`` without ``window`` when no query-key distance of the block reaches it."""
    if spec.window is None or q_pos.numel() == 0 or k_pos.numel() == 0:
        return spec
    reach = max(int(q_pos.max()) - int(k_pos.min()), int(k_pos.max()) - int(q_pos.min()))
    return replace(spec, window=None) if reach < spec.window else spec


def mask_flag(spec: AttnSpec, mask: MaskInfo | None, sq: int, sk: int, device: torch.device) -> bool | None:
    """Whether a fused kernel's own flag says everything a block hides: True (its causal flag: a
    diagonal block, same increasing positions for queries and keys), False (nothing hidden: no
    mask), None (it needs a mask -- padding, documents, a window or chunk that cuts the block, or
    a permuted causal block). O((Sq + Sk) log) -- no mask is built to find out (a chunk that holds
    every query and key hides nothing)."""
    mask = mask or MaskInfo()
    if not mask.is_trivial():
        return None
    if sq == 0 or sk == 0:
        return False
    if mask.q_pos is None and mask.k_pos is None:  # positions 0..n-1: a pure function of the sizes
        return _plain_flag(spec.causal, spec.window, spec.chunk, sq, sk)
    return per_batch(mask, ("flag", spec.causal, spec.window, spec.chunk, sq, sk),
                     lambda: _mask_flag(spec, mask, sq, sk, device))


@functools.lru_cache(maxsize=1024)
def _plain_flag(causal: bool, window: int | None, chunk: int | None, sq: int, sk: int) -> bool | None:
    """:func:`mask_flag` of a block without position tensors, worked out once per process on the
    CPU (every layer of every batch asks the same; nothing of a device is read)."""
    return _mask_flag(AttnSpec(causal=causal, window=window, chunk=chunk), MaskInfo(), sq, sk, torch.device("cpu"))


def _mask_flag(spec: AttnSpec, mask: MaskInfo, sq: int, sk: int, device: torch.device) -> bool | None:
    q_pos, k_pos = mask.positions(sq, sk, device)
    spec = _without_wide_window(_without_whole_chunk(spec, q_pos, k_pos), q_pos, k_pos)
    if spec.window is None and spec.chunk is None:
        if not spec.causal:
            return False
        same = mask.q_pos is mask.k_pos or torch.equal(q_pos, k_pos)
        if sq == sk and same and bool((q_pos[1:] > q_pos[:-1]).all()):
            return True
    plan = plan_block(spec, q_pos.cpu(), k_pos.cpu())
    return False if plan is not None and plan.visible == sq * sk else None


def plan_mask(spec: AttnSpec, mask: MaskInfo | None, sq: int, sk: int, device: torch.device
              ) -> tuple[bool, Tensor | None]:
    """``(is_causal, bool [B or 1, 1, Sq, Sk] mask or None)`` for a kernel that takes a dense mask
    (``sdpa_dense``, a model's eager function): the flag of :func:`mask_flag` where it suffices,
    else the dense mask -- ``Sq x Sk``, which is what such kernels say in their name."""
    flag = mask_flag(spec, mask, sq, sk, device)
    if flag is not None:
        return flag, None
    return False, dense_mask(spec, mask, sq, sk, device)
