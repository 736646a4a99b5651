"""``cuda_flash``: torch's fused CUDA attention ops as a varlen lse kernel (ring and hybrid at full
speed on GPUs, Ulysses on padded / packed rows without a dense mask).

Each tile of :class:`~seqpar.attention.rect_kernel.RectKernel`'s rectangle loop runs on

* ``aten._scaled_dot_product_flash_attention`` (FlashAttention-2) when the tile needs no mask
  (``"none"`` or the op's causal flag), the dtype is float16 / bfloat16 and the head dim <= 256;
* ``aten._scaled_dot_product_efficient_attention`` (memory-efficient, any float dtype) otherwise,
  with an additive mask of the tile's own size (``"positions"`` tiles: windows, permuted layouts).

``cuda_cudnn`` is the same loop with cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention``)
in place of FlashAttention-2 for the tiles that op would take (head dim <= 128); opt-in until its
gpu-marked tests pass on a GPU.

All return the log-sum-exp and have a backward that takes a given ``out`` and ``lse`` -- the
whole row's, merged over tiles and ring blocks -- so every share is exact. KV heads are repeated
for the ops (GQA) and their gradients summed back; head dims are zero-padded to a common multiple
of 8 as SDPA pads them (zero columns change no score; the scale stays the real ``D``'s). Rows of a
tile that see no key are computed against every key and dropped; in the backward they get
``q = 0``, ``dout = 0`` and ``lse = 0``, so they add nothing and no NaN appears.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import compat
from .rect_kernel import RectKernel, pad_head_dim, tile_bias
from .spec import AttnSpec

TILE = 8192
"""The longest run of one tile: the fused ops hold no scores, only a masked tile's bias is ``TILE^2``."""

FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_FLASH_DIM = 256


def _repeat(x: Tensor, n_rep: int) -> Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _sum_heads(x: Tensor, n_kv: int) -> Tensor:
    b, h, s, d = x.shape
    return x if h == n_kv else x.view(b, n_kv, h // n_kv, s, d).sum(dim=2)


def uses_flash(how: str, dtype: torch.dtype, dim: int) -> bool:
    """Whether a tile goes to the FlashAttention op (else the memory-efficient one)."""
    return how != "positions" and dtype in FLASH_DTYPES and dim <= MAX_FLASH_DIM


def _op_dim(q: Tensor, v: Tensor) -> int:
    """The head dim the ops get: q's and v's, the larger, zero-padded to a multiple of 8 (as SDPA pads)."""
    return -(-max(q.shape[-1], v.shape[-1]) // 8) * 8


def _bmhk(x: Tensor) -> Tensor:
    """``x [B, H, S, D]`` in the memory layout the memory-efficient op's forward produces and its
    backward assumes: ``[B, S, H, D]`` contiguous. Given tensors contiguous as ``[B, H, S, D]``
    instead, its half-precision backward returns wrong dq and dk (NaN or off by O(1); dv right:
    as if its ``rowsum(dout * out)`` term read ``out`` with other strides) -- found by the gpu-marked
    tests on an H200 with torch 2.11."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _aligned_bias(bias: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``bias [nq, nk]`` as the memory-efficient op wants it: rows padded to a multiple of 16
    elements (then sliced back), expanded to ``[B, H, nq, nk]``."""
    nq, nk = bias.shape
    padded = bias.new_zeros(nq, -(-nk // 16) * 16)
    padded[:, :nk] = bias
    return padded[:, :nk].expand(shape)


class CudaFlashKernel(RectKernel):
    """torch's FlashAttention-2 / memory-efficient CUDA ops per tile: fused, lse, a backward.
    ``native_gqa``: FlashAttention-2 tiles get the KV heads as they are (no repeated K/V); off in
    the registry until its gpu-marked test passes on a GPU (tests/attention/test_lse_kernels.py)."""

    name = "cuda_flash"
    supports = frozenset({"window", "chunk"})
    tile = TILE
    fused_op = True

    def __init__(self, native_gqa: bool = False) -> None:
        self.native_gqa = native_gqa

    def _prepare(self, q: Tensor, k: Tensor, v: Tensor, how: str = "positions") -> tuple[Tensor, Tensor, Tensor, int]:
        dim = _op_dim(q, v)
        # FlashAttention-2 takes fewer KV heads itself (its backward sums dK/dV over each group);
        # the memory-efficient op does not: its K/V are repeated
        n_rep = 1 if self.native_gqa and uses_flash(how, q.dtype, dim) else q.shape[1] // k.shape[1]
        return (pad_head_dim(q, dim), pad_head_dim(_repeat(k, n_rep), dim), pad_head_dim(_repeat(v, n_rep), dim),
                dim)

    def tile_forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, how: str, q_pos: Tensor,
                     k_pos: Tensor, blk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        qp, kp, vp, dim = self._prepare(q, k, v, how)
        scale, nq = spec.scale_for(q.shape[-1]), q.shape[2]
        causal = how == "causal"
        if uses_flash(how, q.dtype, dim):
            out, lse = compat.cuda_flash_attention(qp, kp, vp, 0.0, causal, False,
                                                                           scale=scale)[:2]
            return out[..., :v.shape[-1]], lse
        bias, seen = tile_bias(spec, how, q_pos, k_pos, q.dtype, blk)
        if bias is not None:  # a row that sees no key would be NaN: let it see all, drop it below
            bias = _aligned_bias(bias.masked_fill(~seen[:, None], 0.0), (*qp.shape[:2], nq, kp.shape[2]))
        out, lse = compat.cuda_efficient_attention(qp, kp, vp, bias, True, 0.0, causal,
                                                                           scale=scale)[:2]
        lse = lse[..., :nq]  # the op pads lse's length to a multiple of 32
        if seen is not None:
            out, lse = out * seen[:, None], lse.masked_fill(~seen, float("-inf"))
        return out[..., :v.shape[-1]], lse

    def tile_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      spec: AttnSpec, how: str, q_pos: Tensor, k_pos: Tensor,
                      blk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        d, dv_dim, n_kv = q.shape[-1], v.shape[-1], k.shape[1]
        qp, kp, vp, dim = self._prepare(q, k, v, how)
        dop, outp = pad_head_dim(dout, dim).contiguous(), pad_head_dim(out, dim).contiguous()
        scale, nq, nk = spec.scale_for(d), q.shape[2], k.shape[2]
        causal = how == "causal"
        lse = lse.float().contiguous()
        no_rng = (torch.empty(2, dtype=torch.int64, device=q.device), torch.empty((), dtype=torch.int64,
                                                                                  device=q.device))
        if uses_flash(how, q.dtype, dim):
            dq, dk, dv = compat.cuda_flash_attention_backward(
                dop, qp, kp, vp, outp, lse, None, None, nq, nk, 0.0, causal, *no_rng, scale=scale)
        else:
            bias, seen = tile_bias(spec, how, q_pos, k_pos, q.dtype, blk)
            if bias is not None:  # rows that see nothing: q = 0 (scores 0) and dout = 0 -> no gradient
                bias = _aligned_bias(bias.masked_fill(~seen[:, None], 0.0), (*qp.shape[:2], nq, kp.shape[2]))
                qp, dop = qp * seen[:, None], dop * seen[:, None]
                lse = lse.masked_fill(~seen, 0.0)  # P = exp(0 - 0): finite, times dS = 0
            lse = torch.nn.functional.pad(lse, (0, -(-nq // 32) * 32 - nq))
            dq, dk, dv, _ = compat.cuda_efficient_attention_backward(
                *(_bmhk(x) for x in (dop, qp, kp, vp)), bias, _bmhk(outp), lse, no_rng[1], no_rng[1], 0.0,
                [True, True, True, False], causal, scale=scale)
        return dq[..., :d], _sum_heads(dk[..., :d], n_kv), _sum_heads(dv[..., :dv_dim], n_kv)


MAX_CUDNN_DIM = 128


def _uses_cudnn(how: str, q: Tensor, v: Tensor) -> bool:
    """Whether ``cuda_cudnn`` runs a tile on cuDNN (decided before K/V are repeated and padded,
    so that the other tiles are prepared once, by ``cuda_flash``)."""
    dim = _op_dim(q, v)
    return uses_flash(how, q.dtype, dim) and dim <= MAX_CUDNN_DIM


class CudnnKernel(CudaFlashKernel):
    """:class:`CudaFlashKernel` with cuDNN's fused attention for unmasked and causal half-precision
    tiles (head dim <= 128); other tiles as ``cuda_flash``."""

    name = "cuda_cudnn"

    def tile_forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, how: str, q_pos: Tensor,
                     k_pos: Tensor, blk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        if not _uses_cudnn(how, q, v):
            return super().tile_forward(q, k, v, spec, how, q_pos, k_pos, blk)
        qp, kp, vp, _ = self._prepare(q, k, v)
        out, lse = compat.cudnn_attention(
            qp, kp, vp, None, True, 0.0, how == "causal", False, scale=spec.scale_for(q.shape[-1]))[:2]
        return out[..., :v.shape[-1]], lse.reshape(q.shape[:3]).float()  # cuDNN's lse: [B, H, Sq, 1]

    def tile_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      spec: AttnSpec, how: str, q_pos: Tensor, k_pos: Tensor,
                      blk: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        if not _uses_cudnn(how, q, v):
            return super().tile_backward(dout, q, k, v, out, lse, spec, how, q_pos, k_pos, blk)
        d, dv_dim, n_kv = q.shape[-1], v.shape[-1], k.shape[1]
        qp, kp, vp, dim = self._prepare(q, k, v)
        dop, outp = pad_head_dim(dout, dim), pad_head_dim(out, dim)
        rng = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: never read
        # no bias, and None for the cumulative lengths (undefined: not the nested-tensor path)
        dq, dk, dv = compat.cudnn_attention_backward(
            *(_bmhk(x) for x in (dop, qp, kp, vp, outp)), lse.float().contiguous()[..., None], rng, rng, None, None,
            None, q.shape[2], k.shape[2], 0.0, how == "causal", scale=spec.scale_for(d))
        return dq[..., :d], _sum_heads(dk[..., :d], n_kv), _sum_heads(dv[..., :dv_dim], n_kv)
