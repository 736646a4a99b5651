"""``tiled``: the oracle's plain-PyTorch math, one tile at a time -- every option (softcap
included), any dtype and device, in O(S) memory.

The portable varlen lse kernel: where no fused kernel honours the options (softcap; float64 or an
unknown device) it runs the rectangle loop of :class:`~seqpar.attention.rect_kernel.RectKernel`
with :class:`~seqpar.attention.reference.ReferenceKernel`'s forward and backward on each tile, so
no score matrix is larger than ``tile x tile`` (:data:`TILE`).
"""

from __future__ import annotations

from torch import Tensor

from .rect_kernel import RectKernel
from .reference import ReferenceKernel
from .spec import AttnSpec, MaskInfo

TILE = 512
"""The longest query or key run of one tile: ``TILE x TILE`` scores per head at a time."""

_REF = ReferenceKernel()


class TiledKernel(RectKernel):
    """The reference math per tile: exact, every option, any device; slower than a fused op."""

    name = "tiled"
    supports = frozenset({"window", "softcap", "chunk"})
    tile = TILE

    @staticmethod
    def _tile_mask(how: str, q_pos: Tensor, k_pos: Tensor, blk: tuple[Tensor, Tensor] | None) -> MaskInfo | None:
        if how == "none":
            return None
        q_blk, k_blk = (None, None) if blk is None else (blk[0][None], blk[1][None])  # one batch row: [1, n]
        return MaskInfo(q_pos=q_pos, k_pos=k_pos, q_blk=q_blk, k_blk=k_blk)

    def tile_forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, how: str, q_pos: Tensor,
                     k_pos: Tensor, blk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        # "none": every pair visible, so causal / window / chunk are dropped for the tile
        tile_spec = spec if how != "none" else AttnSpec(scale=spec.scale, softcap=spec.softcap)
        return _REF.forward(q, k, v, tile_spec, self._tile_mask(how, q_pos, k_pos, blk))

    def tile_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      spec: AttnSpec, how: str, q_pos: Tensor, k_pos: Tensor,
                      blk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        tile_spec = spec if how != "none" else AttnSpec(scale=spec.scale, softcap=spec.softcap)
        return _REF.backward(dout, q, k, v, out, lse, tile_spec, self._tile_mask(how, q_pos, k_pos, blk))
