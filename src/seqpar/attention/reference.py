"""The oracle: exact attention in plain PyTorch math, for a whole sequence or one block.

:func:`reference_attention` (float64) is what every sequence-parallel path is tested against;
:class:`ReferenceKernel` is the same math as an lse kernel (every option, any dtype and device). It
builds the ``[Sq, Sk]`` score matrix: a test and fallback kernel, not a long-sequence one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .spec import AttnSpec, LseKernel, MaskInfo, acc_dtype, dense_mask


def _repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _sum_kv(x: Tensor, n_kv: int) -> Tensor:
    """Inverse of ``_repeat_kv`` for gradients: sum the query heads that share a KV head."""
    b, h, s, d = x.shape
    return x if h == n_kv else x.view(b, n_kv, h // n_kv, s, d).sum(dim=2)


def _scores(q: Tensor, k: Tensor, spec: AttnSpec, mask: MaskInfo | None) -> tuple[Tensor, Tensor | None,
                                                                                 Tensor | None]:
    """Masked scores ``[B, H, Sq, Sk]`` in the compute dtype, the tanh of the softcap and the mask."""
    kr = _repeat_kv(k, q.shape[1] // k.shape[1])
    s = torch.matmul(q, kr.transpose(-1, -2)) * spec.scale_for(q.shape[-1])
    tanh = None
    if spec.softcap is not None:
        tanh = torch.tanh(s / spec.softcap)
        s = spec.softcap * tanh
    allowed = dense_mask(spec, mask, q.shape[2], k.shape[2], q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return s, tanh, allowed


def math_attention(q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None
                   ) -> tuple[Tensor, Tensor]:
    """Differentiable attention in plain PyTorch ops: ``(out [B,H,Sq,Dv], lse [B,H,Sq])``.

    ``spec.sinks [H]`` (differentiable) joins every row's softmax as one more logit with a zero
    value vector; lse includes it. Rows that see no key (and have no sink) give ``out = 0`` and
    ``lse = -inf`` without NaN in either direction.
    """
    if spec.dropout:
        raise ValueError("the reference attention is deterministic: set dropout to 0")
    cdtype = torch.promote_types(q.dtype, torch.float32)
    qc, kc, vc = q.to(cdtype), k.to(cdtype), v.to(cdtype)
    s, _, _ = _scores(qc, kc, spec, mask)
    m = s.amax(dim=-1, keepdim=True)  # [B, H, Sq, 1]
    sink = None if spec.sinks is None else spec.sinks.to(cdtype)[None, :, None, None]  # [1, H, 1, 1]
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    p = torch.exp(s - m)  # masked entries: exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    seen = denom > 0
    out = torch.matmul(p, _repeat_kv(vc, q.shape[1] // k.shape[1])) / torch.where(seen, denom, 1.0)
    lse = torch.where(seen, m + torch.log(torch.where(seen, denom, 1.0)), float("-inf")).squeeze(-1)
    return out.to(q.dtype), lse.to(acc_dtype(q.dtype))


class ReferenceKernel(LseKernel):
    """Plain PyTorch math, every option, any dtype and device: the oracle, and a ring kernel."""

    name = "reference"
    supports = frozenset({"window", "softcap", "chunk"})

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None
                ) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            return math_attention(q, k, v, spec, mask)

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: AttnSpec,
                 mask: MaskInfo | None) -> tuple[Tensor, Tensor, Tensor]:
        # The flash-attention backward: with P = exp(S - lse) (lse of the whole row, possibly
        # merged over blocks), dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K,
        # dK = dS^T Q. Using the global out/lse makes each block's share exact (sinks included:
        # they are in lse, and their zero value vectors add nothing to O).
        cdtype = torch.promote_types(q.dtype, torch.float32)
        qc, kc, vc = q.to(cdtype), k.to(cdtype), v.to(cdtype)
        do, o = dout.to(cdtype), out.to(cdtype)
        n_kv, n_rep = k.shape[1], q.shape[1] // k.shape[1]
        s, tanh, _ = _scores(qc, kc, spec, mask)
        lse_c = lse.to(cdtype)
        lse_c = torch.where(torch.isinf(lse_c), torch.zeros_like(lse_c), lse_c)
        p = torch.exp(s - lse_c[..., None])  # [B, H, Sq, Sk]
        dv = _sum_kv(torch.matmul(p.transpose(-1, -2), do), n_kv)
        dp = torch.matmul(do, _repeat_kv(vc, n_rep).transpose(-1, -2))
        ds = p * (dp - (do * o).sum(dim=-1, keepdim=True))
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        ds = ds * spec.scale_for(q.shape[-1])
        dq = torch.matmul(ds, _repeat_kv(kc, n_rep))
        dk = _sum_kv(torch.matmul(ds.transpose(-1, -2), qc), n_kv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
    window: int | None = None, softcap: float | None = None, chunk: int | None = None,
    sinks: Tensor | None = None, key_padding_mask: Tensor | None = None,
    segment_ids: Tensor | None = None, positions: Tensor | None = None, block_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of the whole sequence, differentiable, any dtype (use float64 as the oracle).

    Layouts: ``q [B, S, H, D]``, ``k [B, S, H_kv, D]``, ``v [B, S, H_kv, Dv]`` (GQA:
    ``H % H_kv == 0``); ``key_padding_mask [B, S]`` (True = real token), ``segment_ids [B, S]``
    (packed documents: a query sees only keys of its own segment), ``positions [S]`` (original
    index of each token, for causal/window/chunk on permuted layouts), ``sinks [H]`` (attention
    sinks, differentiable), ``block_ids [B, S]`` (bidirectional spans, -1 for none: a query sees
    every key of its span too, as transformers' ``blockwise_overlay`` OR-ed with causal). Other
    options as :class:`AttnSpec`. Returns ``out [B, S, H, Dv]`` and ``lse [B, H, S]`` (``-inf``
    and ``out = 0`` where a query sees no key and there is no sink).
    """
    spec = AttnSpec(causal=causal, scale=scale, window=window, softcap=softcap, chunk=chunk, sinks=sinks)
    info = MaskInfo(q_pos=positions, k_pos=positions, key_keep=key_padding_mask, q_seg=segment_ids,
                    k_seg=segment_ids, q_blk=block_ids, k_blk=block_ids)
    out, lse = math_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec, info)
    return out.transpose(1, 2), lse
