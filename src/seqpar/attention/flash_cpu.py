"""``flash_cpu``: the fused CPU attention op that returns the log-sum-exp and has a backward.

``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) computes one tile of the
rectangle loop of :class:`~seqpar.attention.rect_kernel.RectKernel`: with the op's causal flag, no
mask, or an additive mask of the tile's own size (never the block's) -- which carries bidirectional
spans too.
"""

from __future__ import annotations

from torch import Tensor

from .. import compat
from .rect_kernel import RectKernel, pad_head_dim, tile_bias
from .spec import AttnSpec


class CpuFlashKernel(RectKernel):
    """``aten._scaled_dot_product_flash_attention_for_cpu``: fused, returns lse, has a backward.

    The op wants one head dim for q, k and v; when v's differs (MLA) the smaller side gets zero
    columns: zero columns of v give zero output columns (cut off again), zero columns of q and k
    leave the scores unchanged (the scale stays that of the real ``D``).
    """

    name = "flash_cpu"
    supports = frozenset({"window", "chunk"})
    fused_op = True

    def tile_forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, how: str, q_pos: Tensor,
                     k_pos: Tensor, blk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        bias, seen = tile_bias(spec, how, q_pos, k_pos, q.dtype, blk)
        dim = max(q.shape[-1], v.shape[-1])
        out, lse = compat.cpu_flash_attention(
            pad_head_dim(q, dim), pad_head_dim(k, dim), pad_head_dim(v, dim), 0.0, how == "causal",
            attn_mask=bias, scale=spec.scale_for(q.shape[-1]))
        if seen is not None:  # the op reports lse = 0 on rows that see no key
            lse = lse.masked_fill(~seen, float("-inf"))
        return out[..., :v.shape[-1]], lse

    def tile_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      spec: AttnSpec, how: str, q_pos: Tensor, k_pos: Tensor,
                      blk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        bias, _ = tile_bias(spec, how, q_pos, k_pos, q.dtype, blk)
        d, dv_dim = q.shape[-1], v.shape[-1]
        dim = max(d, dv_dim)
        dq, dk, dv = compat.cpu_flash_attention_backward(
            _dense_rows(pad_head_dim(dout, dim)), pad_head_dim(q, dim), pad_head_dim(k, dim), pad_head_dim(v, dim),
            _dense_rows(pad_head_dim(out, dim)), lse.contiguous(), 0.0, how == "causal", attn_mask=bias,
            scale=spec.scale_for(d))
        return dq[..., :d], dk[..., :d], dv[..., :dv_dim]


def _dense_rows(x: Tensor) -> Tensor:
    """``x`` as it is when its head dim is dense (the op takes any other strides: Ulysses' ``[B, H, S, D]``
    views of ``[B, S, H, D]`` memory need no copy), else a contiguous copy (a broadcast gradient)."""
    return x if x.stride(-1) == 1 else x.contiguous()
