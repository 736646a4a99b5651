"""An lse kernel that runs a block as its document rectangles: one tile op per rectangle, partial
results merged -- the varlen loop every fused kernel shares (CPU, CUDA and the portable one).

:func:`~seqpar.attention.varlen.document_rects` cuts a block into the rectangles something sees,
each at most ``tile x tile``; a subclass supplies the tile op (``tile_forward`` / ``tile_backward``)
for one rectangle, given how it must be masked: ``"none"``, ``"causal"`` (the op's own causal flag)
or ``"positions"`` (the rectangle's global positions: a mask of the rectangle's size at most).
The forward merges the rectangles' ``(out, lse)`` in place with
:func:`~seqpar.attention.blocks.merge_into`; the backward gives each rectangle the whole row's
``out`` and ``lse`` -- exact, as a ring block's share is. Memory is linear in the block's length
(plus one tile), work proportional to the visible pairs, and nothing of size ``Sq x Sk`` exists.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor

from .blocks import merge_into
from .spec import AttnSpec, LseKernel, MaskInfo, acc_dtype, check_supported, position_mask
from .varlen import TILE, Rect, document_rects, mask_flag


def pad_head_dim(x: Tensor, n: int) -> Tensor:
    """``[..., d] -> [..., n]`` with zero columns (``n >= d``)."""
    return x if x.shape[-1] == n else F.pad(x, (0, n - x.shape[-1]))


def tile_bias(spec: AttnSpec, how: str, q_pos: Tensor, k_pos: Tensor, dtype: torch.dtype,
              blk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor | None, Tensor | None]:
    """A ``"positions"`` tile's additive mask ``[nq, nk]`` (0 / -inf) and its rows that see a key
    ``[nq]``; ``(None, None)`` for the other kinds of tile. ``blk``: the tile's span ids
    ``(q_blk [nq], k_blk [nk])`` (:attr:`Rect.spans`), OR-ed with its causal part."""
    if how != "positions":
        return None, None
    allowed = position_mask(spec, q_pos, k_pos, blk)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=q_pos.device).masked_fill(~allowed, float("-inf"))
    return bias, allowed.any(dim=-1)


_NO_POS = torch.empty(0, dtype=torch.long)
"""The positions a fused block's tile op gets: only ``"positions"`` tiles read them."""


def _rows(rect: Rect) -> slice:
    return slice(None) if rect.row is None else slice(rect.row, rect.row + 1)


def _blk(rect: Rect, mask: MaskInfo, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """A span rectangle's span ids ``(q_blk [nq], k_blk [nk])`` on ``device``; None for the others."""
    if not rect.spans:
        return None
    (q0, nq), (k0, nk) = rect.q, rect.k
    return mask.q_blk[rect.row, q0:q0 + nq].to(device), mask.k_blk[rect.row, k0:k0 + nk].to(device)


class RectKernel(LseKernel):
    """Base of the varlen lse kernels: the rectangle loop; subclasses give the tile op and ``tile``."""

    tile: int = TILE
    fused_op: bool = False
    """Whether the tile op is a fused op that runs an unmasked or causal block of any length in
    one call without reading positions (the ring's fast path: :meth:`fused_forward`)."""

    @abstractmethod
    def tile_forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, how: str, q_pos: Tensor,
                     k_pos: Tensor, blk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """One rectangle: ``q [b, H, nq, D]``, ``k [b, H_kv, nk, D]``, ``v [b, H_kv, nk, Dv]``, its
        tokens' global positions ``q_pos [nq]``, ``k_pos [nk]`` (on q's device) -> ``(out, lse)``,
        lse in the accumulation dtype and ``-inf`` on rows that see no key of the rectangle.
        ``blk``: the span ids of a ``"positions"`` rectangle with spans (:func:`tile_bias` reads them)."""

    @abstractmethod
    def tile_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      spec: AttnSpec, how: str, q_pos: Tensor, k_pos: Tensor,
                      blk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """One rectangle's ``(dq, dk, dv)`` from the whole row's ``out`` and ``lse`` (``lse`` finite:
        rows that see no key anywhere carry 0 and ``dout``'s share of them is 0)."""

    def fused_forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, causal: bool) -> tuple[Tensor, Tensor]:
        if not self.fused_op:
            return super().fused_forward(q, k, v, spec, causal)
        # one call of the tile op on the whole block, whatever its length: "none" and "causal"
        # tiles hold no bias, and neither fused op keeps Sq x Sk scores (the CPU op's backward
        # took 30 MiB at 8k x 8k, 4 heads, one thread); no rectangles, no accumulator, no merge
        out, lse = self.tile_forward(q, k, v, spec, "causal" if causal else "none", _NO_POS, _NO_POS)
        return out.to(q.dtype), lse.to(acc_dtype(q.dtype))

    def fused_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       spec: AttnSpec, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        if not self.fused_op:
            return super().fused_backward(dout, q, k, v, out, lse, spec, causal)
        # every row of such a block sees a key of it: its merged lse is finite, nothing to clean
        how = "causal" if causal else "none"
        g = self.tile_backward(dout, q, k, v, out, lse.to(acc_dtype(q.dtype)), spec, how, _NO_POS, _NO_POS)
        return g[0].to(q.dtype), g[1].to(k.dtype), g[2].to(v.dtype)

    def _flag(self, q: Tensor, k: Tensor, spec: AttnSpec, mask: MaskInfo | None) -> bool | None:
        """The op's own causal flag where it says everything the block hides (:func:`mask_flag`) and
        the tile op is fused: then one call on the whole block (:meth:`fused_forward`), not its
        ``tile x tile`` rectangles merged -- a causal 4k-token block was 10 calls, 20 with the
        recompute, and the backward's accumulators. None: the rectangles."""
        if not self.fused_op or q.shape[2] == 0 or k.shape[2] == 0:
            return None
        return mask_flag(spec, mask, q.shape[2], k.shape[2], q.device)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None
                ) -> tuple[Tensor, Tensor]:
        check_supported(self, spec)
        flag = self._flag(q, k, spec, mask)
        if flag is not None:
            return self.fused_forward(q, k, v, spec, flag)
        mask = mask or MaskInfo()
        q_pos, k_pos = mask.positions(q.shape[2], k.shape[2], q.device)
        acc = acc_dtype(q.dtype)
        rects = document_rects(spec, mask, q.shape[2], k.shape[2], q.shape[0], self.tile)
        if len(rects) == 1 and rects[0].row is None and rects[0].q == (0, q.shape[2]) and rects[0].how != "positions":
            # one tile holds every row, and every row sees a key of it (a plain or causal block that
            # fits a tile): its result is the block's -- no accumulator, no merge, no cast back
            (k0, nk), how = rects[0].k, rects[0].how
            o_r, l_r = self.tile_forward(q, k[:, :, k0:k0 + nk], v[:, :, k0:k0 + nk], spec, how, q_pos,
                                         k_pos[k0:k0 + nk])
            return o_r.to(q.dtype), l_r.to(acc)
        out = q.new_zeros((*q.shape[:3], v.shape[3]), dtype=acc)  # [B, H, Sq, Dv]
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc)  # [B, H, Sq]
        for rect in rects:
            (q0, nq), (k0, nk), rows_of = rect.q, rect.k, _rows(rect)
            o_r, l_r = self.tile_forward(q[rows_of, :, q0:q0 + nq], k[rows_of, :, k0:k0 + nk],
                                         v[rows_of, :, k0:k0 + nk], spec, rect.how, q_pos[q0:q0 + nq],
                                         k_pos[k0:k0 + nk], _blk(rect, mask, q.device))
            rows = (rows_of, slice(None), slice(q0, q0 + nq))
            merge_into(out[rows], lse[rows], o_r, l_r.to(acc))  # in place: views of the rows
        return out.to(q.dtype), lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: AttnSpec,
                 mask: MaskInfo | None) -> tuple[Tensor, Tensor, Tensor]:
        flag = self._flag(q, k, spec, mask)
        if flag is not None:
            return self.fused_backward(dout, q, k, v, out, lse, spec, flag)
        acc = acc_dtype(q.dtype)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).to(acc)
        mask = mask or MaskInfo()
        q_pos, k_pos = mask.positions(q.shape[2], k.shape[2], q.device)
        rects = document_rects(spec, mask, q.shape[2], k.shape[2], q.shape[0], self.tile)
        if len(rects) == 1 and rects[0].row is None and rects[0].q == (0, q.shape[2]) and rects[0].k == (0, k.shape[2]):
            # one tile holds the whole block: its gradients are the block's, no accumulators
            g = self.tile_backward(dout, q, k, v, out, lse, spec, rects[0].how, q_pos, k_pos)
            return g[0].to(q.dtype), g[1].to(k.dtype), g[2].to(v.dtype)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        for rect in rects:
            (q0, nq), (k0, nk), rows_of = rect.q, rect.k, _rows(rect)
            qs = (rows_of, slice(None), slice(q0, q0 + nq))
            ks = (rows_of, slice(None), slice(k0, k0 + nk))
            g = self.tile_backward(dout[qs], q[qs], k[ks], v[ks], out[qs], lse[qs], spec, rect.how,
                                   q_pos[q0:q0 + nq], k_pos[k0:k0 + nk], _blk(rect, mask, q.device))
            dq[qs] += g[0]
            dk[ks] += g[1]
            dv[ks] += g[2]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
