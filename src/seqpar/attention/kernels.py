"""Local attention kernels: what one rank computes once the collectives have brought it its data.

The contract (layouts, lse, backward) is in :mod:`seqpar.attention.spec`. Here: the fused CPU
kernel with lse (``flash_cpu``), torch's SDPA (``sdpa``: any backend torch picks, no lse), the
registry by name, and :func:`attend`, which makes any kernel differentiable, folds attention sinks
into an lse kernel's result and runs the kernel under a :class:`~seqpar.comm.guard.Guard`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..comm.guard import Guard, guarded
from .blocks import fold_sinks, sinks_grad
from .flash_cpu import CpuFlashKernel
from .reference import ReferenceKernel
from .spec import AttnSpec, Kernel, LocalKernel, LseKernel, MaskInfo, acc_dtype, check_supported, plan_mask


class SdpaKernel(LocalKernel):
    """``torch.nn.functional.scaled_dot_product_attention``: any backend torch picks (flash,
    memory-efficient, cuDNN on GPU). Returns no lse, so it serves Ulysses but not a ring."""

    name = "sdpa"
    supports = frozenset({"window", "chunk", "dropout"})

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


def _placeholder(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """What a rank whose kernel failed sends on: ``out = 0 [B, H, Sq, Dv]``, ``lse = -inf [B, H, Sq]``."""
    return (q.new_zeros(q.shape[:3] + (v.shape[3],)),
            q.new_full(q.shape[:3], float("-inf"), dtype=acc_dtype(q.dtype)))


class _Attend(torch.autograd.Function):
    """Forward: ``kernel.forward``, sinks folded into (out, lse). Backward: ``kernel.backward`` with
    the saved (folded) out and lse -- exact, as for a ring block -- and d sinks from the same.
    Under a guard a failing kernel gives placeholders (zeros) and the guard keeps the error."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec, mask, kernel, guard):
        plain = replace(spec, sinks=None)  # the kernel computes without sinks; they are folded here
        res = guarded(guard, kernel.forward, q, k, v, plain, mask)
        out, lse = res if res is not None else _placeholder(q, v)
        if sinks is not None:
            out, lse = fold_sinks(out.to(lse.dtype), lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.spec, ctx.mask, ctx.kernel, ctx.guard = plain, mask, kernel, guard
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grads = guarded(ctx.guard, ctx.kernel.backward, dout, q, k, v, out, lse, ctx.spec, ctx.mask)
        dq, dk, dv = grads if grads is not None else (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None


class _GuardedLocal(torch.autograd.Function):
    """Forward: a local kernel under the guard, its own autograd graph kept aside. Backward: that
    graph's backward under the guard (zeros on failure), so a failing rank still joins the rest of
    the call's backward communication. Parameters the kernel reads itself get their gradients
    as usual (the inner backward reaches them, as in reentrant checkpointing). The kept graph holds
    what the kernel's own backward holds anyway -- except under non-reentrant activation
    checkpointing, where its inputs and output now stay alive until the backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec, mask, kernel, guard):
        leaves = [None if x is None else x.detach().requires_grad_(x.requires_grad) for x in (q, k, v, sinks)]
        with torch.enable_grad():
            out = guard.call(kernel, *leaves[:3], spec=replace(spec, sinks=leaves[3]), mask=mask)
        ctx.leaves, ctx.inner, ctx.guard = leaves, out, guard
        return (out if out is not None else _placeholder(q, v)[0]).detach()

    @staticmethod
    def backward(ctx, dout):
        leaves, inner = ctx.leaves, ctx.inner

        def inner_backward() -> list[Tensor | None]:
            for x in leaves:
                if x is not None:
                    x.grad = None
            if inner.requires_grad:
                torch.autograd.backward(inner, dout)
            return [None if x is None else x.grad for x in leaves]

        grads = (ctx.guard.call(inner_backward) if inner is not None else None) or [None] * 4
        return (*(torch.zeros_like(x) if g is None and need else g
                  for g, x, need in zip(grads, leaves, ctx.needs_input_grad[:4], strict=True)), None, None, None, None)


def attend(q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None, kernel: Kernel,
           guard: Guard | None = None) -> Tensor:
    """Differentiable attention of one block with any kernel; returns ``out [B, H, Sq, Dv]``.

    ``spec.sinks [H]`` (this block's query heads) are folded into an lse kernel's result; a local
    kernel must honour them itself (see :func:`check_supported`). With ``guard`` the kernel's
    forward and backward run under it: a failure gives zeros here and is raised by the guard's fence.
    """
    check_supported(kernel, spec)
    if isinstance(kernel, LseKernel):
        return _Attend.apply(q, k, v, spec.sinks, spec, mask, kernel, guard)[0]
    if guard is None:
        return kernel(q, k, v, spec=spec, mask=mask)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, spec.sinks)):
        return _GuardedLocal.apply(q, k, v, spec.sinks, spec, mask, kernel, guard)
    out = guard.call(kernel, q, k, v, spec=spec, mask=mask)
    return out if out is not None else _placeholder(q, v)[0]


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


def default_lse_kernel(q: Tensor, spec: AttnSpec) -> str:
    """The fused CPU kernel where it honours the options (sinks are folded around any lse kernel),
    else the reference (softcap, GPU)."""
    fast = KERNELS["flash_cpu"].supports or frozenset()
    return "flash_cpu" if q.device.type == "cpu" and spec.options() - {"sinks"} <= fast else "reference"


def lse_kernel(kernel: KernelArg) -> LseKernel:
    """Like :func:`get_kernel`, but the kernel must return lse and have a backward (ring attention)."""
    k = get_kernel(kernel)
    if not isinstance(k, LseKernel):
        raise ValueError(f"ring attention needs a kernel that returns the log-sum-exp and has a backward;"
                         f" {k.name!r} does not. Use kernel='flash_cpu' (CPU) or 'reference'")
    return k
