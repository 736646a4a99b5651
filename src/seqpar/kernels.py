"""Local attention kernels: what one rank computes once the collectives have brought it its data.

Every kernel works on one block of queries against one block of keys, in the torch layout
``q [B, H, Sq, D]``, ``k, v [B, H_kv, Sk, D]`` (``H % H_kv == 0``, KV heads not repeated). Which
keys a query may see is described by an :class:`AttnSpec` (causal, window, softcap, scale) and a
:class:`MaskInfo` (global token positions, key padding, packed-document segment ids), so the same
kernel serves a whole sequence (Ulysses) and one block of a ring whose tokens are permuted (zigzag).

A kernel is an object with

* ``forward(q, k, v, spec, mask) -> (out [B, H, Sq, D], lse [B, H, Sq])`` -- lse in float32
  (float64 for float64 inputs), ``-inf`` on rows that see no key, where ``out`` is 0;
* ``backward(dout, q, k, v, out, lse, spec, mask) -> (dq, dk, dv)`` -- with ``out`` and ``lse``
  possibly those of the *whole* attention (ring attention passes the merged ones), which is what
  makes a blockwise backward exact;
* ``supports``: the options of :class:`AttnSpec` it honours. A kernel asked for an option it
  cannot honour raises ``ValueError`` (see :func:`check_supported`) instead of ignoring it.

``attend(q, k, v, spec, mask, kernel)`` turns a kernel into a differentiable function.
A plain callable ``fn(q, k, v, *, spec, mask) -> out [B, H, Sq, D]`` (differentiable by itself)
is accepted wherever only the output is needed (Ulysses), for wrapping any local attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class AttnSpec:
    """What attention computes, independent of how it is split.

    ``window``: a key at position k is visible from a query at q only if ``q - k < window``
    (with ``causal``), or ``|q - k| < window`` (without), as transformers' ``sliding_window``.
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` after scaling (Gemma 2).
    """

    causal: bool = False
    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    dropout: float = 0.0

    def scale_for(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)

    def options(self) -> set[str]:
        used = set()
        if self.window is not None:
            used.add("window")
        if self.softcap is not None:
            used.add("softcap")
        if self.dropout:
            used.add("dropout")
        return used


@dataclass(frozen=True)
class MaskInfo:
    """Which keys of a block each query may see, in global token coordinates.

    q_pos [Sq], k_pos [Sk]  long: index of each token in the unsharded sequence (None: 0..S-1);
                                  causal and window compare these, so permuted layouts stay exact.
    key_keep [B, Sk]        bool: False marks a padding key.
    q_seg [B, Sq], k_seg [B, Sk]  long: document id of each token in a packed row; a query sees
                                  only keys of its own document.
    """

    q_pos: Tensor | None = None
    k_pos: Tensor | None = None
    key_keep: Tensor | None = None
    q_seg: Tensor | None = None
    k_seg: Tensor | None = None

    def is_trivial(self) -> bool:
        return self.key_keep is None and self.q_seg is None and self.k_seg is None

    def positions(self, sq: int, sk: int, device: torch.device) -> tuple[Tensor, Tensor]:
        q_pos = self.q_pos if self.q_pos is not None else torch.arange(sq, device=device)
        k_pos = self.k_pos if self.k_pos is not None else torch.arange(sk, device=device)
        return q_pos, k_pos

    def with_positions(self, q_pos: Tensor | None, k_pos: Tensor | None) -> MaskInfo:
        return replace(self, q_pos=q_pos, k_pos=k_pos)


def position_mask(spec: AttnSpec, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
    """The causal / window part of the mask, ``[Sq, Sk]`` bool (True = visible), or None."""
    if not spec.causal and spec.window is None:
        return None
    diff = q_pos[:, None] - k_pos[None, :]  # [Sq, Sk]
    allowed = torch.ones_like(diff, dtype=torch.bool)
    if spec.causal:
        allowed &= diff >= 0
    if spec.window is not None:
        allowed &= (diff < spec.window) if spec.causal else (diff.abs() < spec.window)
    return allowed


def dense_mask(spec: AttnSpec, mask: MaskInfo | None, sq: int, sk: int, device: torch.device) -> Tensor | None:
    """Everything that hides keys, as one bool ``[B or 1, 1, Sq, Sk]`` (True = visible), or None."""
    mask = mask or MaskInfo()
    q_pos, k_pos = mask.positions(sq, sk, device)
    out = position_mask(spec, q_pos, k_pos)
    out = None if out is None else out[None, None]
    if mask.key_keep is not None:
        keep = mask.key_keep[:, None, None, :]  # [B, 1, 1, Sk]
        out = keep if out is None else out & keep
    if mask.q_seg is not None or mask.k_seg is not None:
        if mask.q_seg is None or mask.k_seg is None:
            raise ValueError("packed sequences need segment ids for both queries and keys")
        same = mask.q_seg[:, None, :, None] == mask.k_seg[:, None, None, :]  # [B, 1, Sq, Sk]
        out = same if out is None else out & same
    return out


def block_is_empty(spec: AttnSpec, q_pos: Tensor, k_pos: Tensor) -> bool:
    """True when causal/window hide every key of the block from every query (skip it)."""
    if spec.causal and int(k_pos.min()) > int(q_pos.max()):
        return True  # the common case, without building the [Sq, Sk] mask
    allowed = position_mask(spec, q_pos, k_pos)
    return allowed is not None and not bool(allowed.any())


def plan_mask(spec: AttnSpec, mask: MaskInfo | None, sq: int, sk: int, device: torch.device
              ) -> tuple[bool, Tensor | None]:
    """How a fused kernel should mask a block: ``(is_causal, dense bool mask or None)``.

    Uses the kernels' own causal flag when the block is a diagonal one (same positions for queries
    and keys) and no mask at all when every key is visible, so fast paths stay fast.
    """
    mask = mask or MaskInfo()
    if mask.is_trivial():
        q_pos, k_pos = mask.positions(sq, sk, device)
        if spec.window is None and spec.causal and sq == sk and (
                mask.q_pos is mask.k_pos or torch.equal(q_pos, k_pos)) and bool(
                (q_pos[1:] > q_pos[:-1]).all()):
            return True, None
        allowed = position_mask(spec, q_pos, k_pos)
        if allowed is None or bool(allowed.all()):
            return False, None
        return False, allowed[None, None]
    return False, dense_mask(spec, mask, sq, sk, device)


class Kernel(Protocol):
    name: str
    supports: frozenset[str]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None
                ) -> tuple[Tensor, Tensor]: ...

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 spec: AttnSpec, mask: MaskInfo | None) -> tuple[Tensor, Tensor, Tensor]: ...


def check_supported(kernel: Any, spec: AttnSpec) -> None:
    """Raise ValueError if ``spec`` asks for an option ``kernel`` cannot honour."""
    supports = getattr(kernel, "supports", None)
    if supports is None:
        return  # a plain callable receives the spec and is trusted to read it
    missing = spec.options() - set(supports)
    if missing:
        name = getattr(kernel, "name", type(kernel).__name__)
        raise ValueError(
            f"attention kernel {name!r} cannot honour {sorted(missing)}; use kernel='reference'"
            f" (supports everything) or drop the option"
        )


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    """Differentiable attention in plain PyTorch ops: ``(out [B,H,Sq,D], lse [B,H,Sq])``.

    Rows that see no key give ``out = 0`` and ``lse = -inf`` without NaN in either direction.
    """
    if spec.dropout:
        raise ValueError("the reference attention is deterministic: set dropout to 0")
    cdtype = torch.promote_types(q.dtype, torch.float32)
    qc, kc, vc = q.to(cdtype), k.to(cdtype), v.to(cdtype)
    s, _, _ = _scores(qc, kc, spec, mask)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    p = torch.exp(s - m)  # masked entries: exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True)
    seen = denom > 0
    out = torch.matmul(p, _repeat_kv(vc, q.shape[1] // k.shape[1])) / torch.where(seen, denom, 1.0)
    lse = torch.where(seen, m + torch.log(torch.where(seen, denom, 1.0)), float("-inf")).squeeze(-1)
    return out.to(q.dtype), lse.to(_lse_dtype(q.dtype))


class ReferenceKernel:
    """Plain PyTorch math, every option, any dtype and device: the oracle, and a ring kernel."""

    name = "reference"
    supports = frozenset({"window", "softcap"})

    def forward(self, q, k, v, spec, mask):
        with torch.no_grad():
            return math_attention(q, k, v, spec, mask)

    def backward(self, dout, q, k, v, out, lse, spec, mask):
        # The flash-attention backward: with P = exp(S - lse) (lse of the whole row, possibly
        # merged over blocks), dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K,
        # dK = dS^T Q. Using the global out/lse makes each block's share exact.
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


class CpuFlashKernel:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: fused, returns lse, has a backward."""

    name = "flash_cpu"
    supports = frozenset({"window"})

    @staticmethod
    def _bias(spec: AttnSpec, mask: MaskInfo | None, q: Tensor, k: Tensor
              ) -> tuple[Tensor | None, bool, Tensor | None]:
        """(additive float mask or None, is_causal flag, rows-that-see-something or None)."""
        causal, allowed = plan_mask(spec, mask, q.shape[2], k.shape[2], q.device)
        if allowed is None:
            return None, causal, None
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~allowed, float("-inf"))
        return bias, False, allowed.any(dim=-1)  # [B or 1, 1, Sq]

    def forward(self, q, k, v, spec, mask):
        check_supported(self, spec)
        bias, causal, seen = self._bias(spec, mask, q, k)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=spec.scale_for(q.shape[-1]))
        lse = lse.to(_lse_dtype(q.dtype))
        if seen is not None:  # the op reports lse = 0 on rows that see no key
            lse = lse.masked_fill(~seen, float("-inf"))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, spec, mask):
        bias, causal, _ = self._bias(spec, mask, q, k)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).to(_lse_dtype(q.dtype))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal,
            attn_mask=bias, scale=spec.scale_for(q.shape[-1]))
        return dq, dk, dv


class SdpaKernel:
    """``torch.nn.functional.scaled_dot_product_attention``: any backend torch picks (flash,
    memory-efficient, cuDNN on GPU). Returns no lse, so it serves Ulysses but not a ring."""

    name = "sdpa"
    supports = frozenset({"window", "dropout"})

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, spec: AttnSpec, mask: MaskInfo | None) -> Tensor:
        check_supported(self, spec)
        gqa = q.shape[1] != k.shape[1]
        causal, allowed = plan_mask(spec, mask, q.shape[2], k.shape[2], q.device)
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=spec.dropout, is_causal=causal,
                                                  scale=spec.scale_for(q.shape[-1]), enable_gqa=gqa)
        seen = allowed.any(dim=-1, keepdim=True)  # [B or 1, 1, Sq, 1]
        # A row that sees no key would be NaN: let it see everything, then zero it.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~seen, dropout_p=spec.dropout,
                                             scale=spec.scale_for(q.shape[-1]), enable_gqa=gqa)
        return out * seen


class _Attend(torch.autograd.Function):
    """Forward: ``kernel.forward``. Backward: ``kernel.backward`` with the saved out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, spec, mask, kernel):
        out, lse = kernel.forward(q, k, v, spec, mask)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.mask, ctx.kernel = spec, mask, kernel
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, ctx.spec, ctx.mask)
        return dq, dk, dv, None, None, None


def attend(q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None,
           kernel: Kernel | Callable[..., Tensor]) -> Tensor:
    """Differentiable attention of one block with any kernel; returns ``out [B, H, Sq, D]``."""
    check_supported(kernel, spec)
    if hasattr(kernel, "forward") and hasattr(kernel, "backward"):
        return _Attend.apply(q, k, v, spec, mask, kernel)[0]
    return kernel(q, k, v, spec=spec, mask=mask)


KERNELS: dict[str, Any] = {
    "reference": ReferenceKernel(),
    "flash_cpu": CpuFlashKernel(),
    "sdpa": SdpaKernel(),
}


def get_kernel(kernel: str | Any) -> Any:
    """A kernel by name (``reference``, ``flash_cpu``, ``sdpa``) or the object itself."""
    if isinstance(kernel, str):
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {sorted(KERNELS)}"
                             " or pass a kernel object / callable")
        return KERNELS[kernel]
    if not callable(kernel) and not (hasattr(kernel, "forward") and hasattr(kernel, "backward")):
        raise ValueError(f"kernel must be a name, a Kernel object or a callable, got {type(kernel).__name__}")
    return kernel


def lse_kernel(kernel: str | Any) -> Any:
    """Like :func:`get_kernel`, but the kernel must return lse and have a backward (ring attention)."""
    k = get_kernel(kernel)
    if not (hasattr(k, "forward") and hasattr(k, "backward")):
        name = getattr(k, "name", type(k).__name__)
        raise ValueError(f"ring attention needs a kernel that returns the log-sum-exp and has a backward;"
                         f" {name!r} does not. Use kernel='flash_cpu' (CPU) or 'reference'")
    return k
