"""Local attention kernels: what one rank computes once the collectives have brought it its data.

The contract (layouts, lse, backward) is in :mod:`seqpar.attention.spec`. Here: the fused CPU
kernel with lse (``flash_cpu``), torch's SDPA (``sdpa``: any backend torch picks, no lse), the
registry by name, and :func:`attend`, which makes any kernel differentiable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import ReferenceKernel
from .spec import AttnSpec, Kernel, LocalKernel, LseKernel, MaskInfo, acc_dtype, check_supported, plan_mask


class CpuFlashKernel(LseKernel):
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

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None
                ) -> tuple[Tensor, Tensor]:
        check_supported(self, spec)
        bias, causal, seen = self._bias(spec, mask, q, k)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=spec.scale_for(q.shape[-1]))
        lse = lse.to(acc_dtype(q.dtype))
        if seen is not None:  # the op reports lse = 0 on rows that see no key
            lse = lse.masked_fill(~seen, float("-inf"))
        return out, lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: AttnSpec,
                 mask: MaskInfo | None) -> tuple[Tensor, Tensor, Tensor]:
        bias, causal, _ = self._bias(spec, mask, q, k)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).to(acc_dtype(q.dtype))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal,
            attn_mask=bias, scale=spec.scale_for(q.shape[-1]))
        return dq, dk, dv


class SdpaKernel(LocalKernel):
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


class FunctionKernel(LocalKernel):
    """A plain function ``fn(q, k, v, *, spec, mask) -> out`` as a kernel; it reads the spec itself."""

    supports = None

    def __init__(self, fn: Callable[..., Tensor]) -> None:
        self.fn, self.name = fn, getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, spec: AttnSpec, mask: MaskInfo | None) -> Tensor:
        return self.fn(q, k, v, spec=spec, mask=mask)


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


def attend(q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None, kernel: Kernel) -> Tensor:
    """Differentiable attention of one block with any kernel; returns ``out [B, H, Sq, Dv]``."""
    check_supported(kernel, spec)
    if isinstance(kernel, LseKernel):
        return _Attend.apply(q, k, v, spec, mask, kernel)[0]
    return kernel(q, k, v, spec=spec, mask=mask)


KERNELS: dict[str, Kernel] = {
    "reference": ReferenceKernel(),
    "flash_cpu": CpuFlashKernel(),
    "sdpa": SdpaKernel(),
}

KernelArg = str | Kernel | Callable[..., Tensor]
"""What the attention functions accept as ``kernel``: a name of :data:`KERNELS`, a kernel object,
or a plain function ``fn(q, k, v, *, spec, mask) -> out``."""


def get_kernel(kernel: KernelArg) -> Kernel:
    """A kernel by name (``reference``, ``flash_cpu``, ``sdpa``), a kernel object as it is, or a
    plain function wrapped in :class:`FunctionKernel`. Raises ValueError for anything else."""
    if isinstance(kernel, str):
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {sorted(KERNELS)}"
                             " or pass a kernel object / callable")
        return KERNELS[kernel]
    if isinstance(kernel, (LseKernel, LocalKernel)):
        return kernel
    if callable(kernel):
        return FunctionKernel(kernel)
    raise ValueError(f"kernel must be a name, a Kernel object or a callable, got {type(kernel).__name__}")


def lse_kernel(kernel: KernelArg) -> LseKernel:
    """Like :func:`get_kernel`, but the kernel must return lse and have a backward (ring attention)."""
    k = get_kernel(kernel)
    if not isinstance(k, LseKernel):
        raise ValueError(f"ring attention needs a kernel that returns the log-sum-exp and has a backward;"
                         f" {k.name!r} does not. Use kernel='flash_cpu' (CPU) or 'reference'")
    return k
