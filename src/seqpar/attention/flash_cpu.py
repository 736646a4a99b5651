"""``flash_cpu``: the fused CPU attention op that returns the log-sum-exp and has a backward.

``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) computes one tile. A block
never gets a block-sized mask: it runs as the rectangles of :mod:`.varlen` -- one per document
(padding keys in none), tiled to at most ``TILE x TILE`` -- each with the op's causal flag, no mask,
or a mask of its own size; the rectangles' partial results merge through
:func:`~seqpar.attention.blocks.merge_partials`, and their backward uses the whole row's out and
lse, so each rectangle's share is exact. Memory is linear in the block's length, work proportional
to the visible pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .blocks import merge_partials
from .spec import AttnSpec, LseKernel, MaskInfo, acc_dtype, check_supported, position_mask
from .varlen import Rect, document_rects


def _pad_dim(x: Tensor, n: int) -> Tensor:
    """``[..., d] -> [..., n]`` with zero columns (``n >= d``)."""
    return x if x.shape[-1] == n else F.pad(x, (0, n - x.shape[-1]))


def _rows(rect: Rect) -> slice:
    return slice(None) if rect.row is None else slice(rect.row, rect.row + 1)


class CpuFlashKernel(LseKernel):
    """``aten._scaled_dot_product_flash_attention_for_cpu``: fused, returns lse, has a backward.

    The op wants one head dim for q, k and v; when v's differs (MLA) the smaller side gets zero
    columns: zero columns of v give zero output columns (cut off again), zero columns of q and k
    leave the scores unchanged (the scale stays that of the real ``D``).
    """

    name = "flash_cpu"
    supports = frozenset({"window", "chunk"})

    @staticmethod
    def _rect_bias(spec: AttnSpec, positions: tuple[Tensor, Tensor], rect: Rect, q: Tensor
                   ) -> tuple[Tensor | None, bool, Tensor | None]:
        """A rectangle's (bias of its own size or None, causal flag, rows that see a key or None);
        ``positions``: the block's ``(q_pos, k_pos)``, computed once per call."""
        if rect.how != "positions":
            return None, rect.how == "causal", None
        q_pos, k_pos = positions
        (q0, nq), (k0, nk) = rect.q, rect.k
        allowed = position_mask(spec, q_pos[q0:q0 + nq].to(q.device), k_pos[k0:k0 + nk].to(q.device))
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
        return bias, False, allowed.any(dim=-1)  # [nq, nk], [nq]

    @staticmethod
    def _op(q: Tensor, k: Tensor, v: Tensor, causal: bool, bias: Tensor | None, scale: float
            ) -> tuple[Tensor, Tensor]:
        dim = max(q.shape[-1], v.shape[-1])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _pad_dim(q, dim), _pad_dim(k, dim), _pad_dim(v, dim), 0.0, causal, attn_mask=bias, scale=scale)
        return out[..., :v.shape[-1]], lse

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None
                ) -> tuple[Tensor, Tensor]:
        check_supported(self, spec)
        mask = mask or MaskInfo()
        positions = mask.positions(q.shape[2], k.shape[2], q.device)
        scale = spec.scale_for(q.shape[-1])
        acc = acc_dtype(q.dtype)
        out = q.new_zeros((*q.shape[:3], v.shape[3]), dtype=acc)  # [B, H, Sq, Dv]
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc)  # [B, H, Sq]
        for rect in document_rects(spec, mask, q.shape[2], k.shape[2], q.shape[0]):
            (q0, nq), (k0, nk), rows_of = rect.q, rect.k, _rows(rect)
            bias, causal, seen = self._rect_bias(spec, positions, rect, q)
            o_r, l_r = self._op(q[rows_of, :, q0:q0 + nq], k[rows_of, :, k0:k0 + nk], v[rows_of, :, k0:k0 + nk],
                                causal, bias, scale)
            l_r = l_r.to(acc)
            if seen is not None:  # the op reports lse = 0 on rows that see no key
                l_r = l_r.masked_fill(~seen, float("-inf"))
            rows = (rows_of, slice(None), slice(q0, q0 + nq))
            out[rows], lse[rows] = merge_partials(out[rows], lse[rows], o_r, l_r)
        return out.to(q.dtype), lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: AttnSpec,
                 mask: MaskInfo | None) -> tuple[Tensor, Tensor, Tensor]:
        # each rectangle's share of the gradient, from the whole row's out and lse (exact, as a ring block)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).to(acc_dtype(q.dtype))
        mask = mask or MaskInfo()
        positions = mask.positions(q.shape[2], k.shape[2], q.device)
        acc = acc_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        scale = spec.scale_for(q.shape[-1])
        for rect in document_rects(spec, mask, q.shape[2], k.shape[2], q.shape[0]):
            (q0, nq), (k0, nk), rows_of = rect.q, rect.k, _rows(rect)
            bias, causal, _ = self._rect_bias(spec, positions, rect, q)
            qs = (rows_of, slice(None), slice(q0, q0 + nq))
            ks = (rows_of, slice(None), slice(k0, k0 + nk))
            g = self._op_backward(dout[qs], q[qs], k[ks], v[ks], out[qs], lse[qs], causal, bias, scale)
            dq[qs] += g[0]
            dk[ks] += g[1]
            dv[ks] += g[2]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    @staticmethod
    def _op_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                     bias: Tensor | None, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        d, dv_dim = q.shape[-1], v.shape[-1]
        dim = max(d, dv_dim)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _pad_dim(dout, dim).contiguous(), _pad_dim(q, dim), _pad_dim(k, dim), _pad_dim(v, dim),
            _pad_dim(out, dim).contiguous(), lse.contiguous(), 0.0, causal, attn_mask=bias, scale=scale)
        return dq[..., :d], dk[..., :d], dv[..., :dv_dim]
