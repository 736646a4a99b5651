"""The oracle: exact attention over the whole, unsharded sequence in plain PyTorch."""

from __future__ import annotations

from torch import Tensor

from .kernels import AttnSpec, MaskInfo, math_attention


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
    window: int | None = None, softcap: float | None = None, key_padding_mask: Tensor | None = None,
    segment_ids: Tensor | None = None, positions: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of the whole sequence, differentiable, any dtype (use float64 as the oracle).

    Layouts: ``q [B, S, H, D]``, ``k, v [B, S, H_kv, D]`` (GQA: ``H % H_kv == 0``);
    ``key_padding_mask [B, S]`` (True = real token), ``segment_ids [B, S]`` (packed documents: a
    query sees only keys of its own segment), ``positions [S]`` (original index of each token, for
    causal/window on permuted layouts). Returns ``out [B, S, H, D]`` and ``lse [B, H, S]``
    (``-inf`` and ``out = 0`` where a query sees no key).
    """
    spec = AttnSpec(causal=causal, scale=scale, window=window, softcap=softcap)
    info = MaskInfo(q_pos=positions, k_pos=positions, key_keep=key_padding_mask, q_seg=segment_ids,
                    k_seg=segment_ids)
    out, lse = math_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec, info)
    return out.transpose(1, 2), lse
