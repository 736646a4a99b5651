"""The autograd around one block's kernel call: what :func:`~seqpar.attention.kernels.attend` applies.

::

    Attend        an lse kernel: its forward and backward, attention sinks folded into (out, lse)
    GuardedLocal  a local kernel under a guard: its own autograd graph kept aside, run in the backward
    placeholder   what a rank whose kernel failed sends on (zeros, lse = -inf)

Under a :class:`~seqpar.comm.guard.Guard` a failing kernel gives placeholders here and the guard
keeps the error, so the failing rank still joins the call's communication; the guard's fence raises it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ..comm.guard import guarded
from .blocks import fold_sinks, sinks_grad
from .spec import acc_dtype


def placeholder(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """What a rank whose kernel failed (or that has no query heads) sends on: ``out = 0 [B, H, Sq, Dv]``,
    ``lse = -inf [B, H, Sq]``."""
    return (q.new_zeros(q.shape[:3] + (v.shape[3],)),
            q.new_full(q.shape[:3], float("-inf"), dtype=acc_dtype(q.dtype)))


class Attend(torch.autograd.Function):
    """Forward: ``kernel.forward``, sinks folded into (out, lse). Backward: ``kernel.backward`` with
    the saved (folded) out and lse -- exact, as for a ring block -- and d sinks from the same.
    Under a guard a failing kernel gives placeholders (zeros) and the guard keeps the error."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec, mask, kernel, guard):
        plain = replace(spec, sinks=None)  # the kernel computes without sinks; they are folded here
        res = guarded(guard, kernel.forward, q, k, v, plain, mask)
        out, lse = res if res is not None else placeholder(q, v)
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


def _pack_detached(t: Tensor) -> Tensor:
    # detached: a saved *output* kept as itself would hold its own grad_fn (out -> node -> out), a
    # cycle in C++ that Python's gc cannot see -- every step's inner graph would stay alive
    return t.detach()


def _unpack(t: Tensor) -> Tensor:
    return t


class GuardedLocal(torch.autograd.Function):
    """Forward: a local kernel under the guard, its own autograd graph kept aside. Backward: that
    graph's backward under the guard (zeros on failure), so a failing rank still joins the rest of
    the call's backward communication. Parameters the kernel reads itself get their gradients
    as usual (the inner backward reaches them, as in reentrant checkpointing). The kept graph holds
    what the kernel's own backward holds anyway -- except under non-reentrant activation
    checkpointing, where its inputs and output now stay alive until the backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec, mask, kernel, guard):
        leaves = [None if x is None else x.detach().requires_grad_(x.requires_grad) for x in (q, k, v, sinks)]
        # the inner graph keeps its tensors itself (q, k, v, out are held here anyway): packed by an outer
        # non-reentrant checkpoint, they would be recomputed a second time in the inner backward's graph task
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_pack_detached, _unpack):
            out = guard.call(kernel, *leaves[:3], spec=replace(spec, sinks=leaves[3]), mask=mask)
        ctx.leaves, ctx.inner, ctx.guard = leaves, out, guard
        return (out if out is not None else placeholder(q, v)[0]).detach()

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
        # the inner graph ran its one backward (its buffers are freed); drop it, the leaves and their
        # .grad too: kept on ctx they would hold dq, dk, dv (and the inner graph's tensors) for as long as
        # the outer graph is referenced (a loss kept until the next step: a second copy of them at its peak)
        for x in leaves:
            if x is not None:
                x.grad = None
        ctx.leaves = ctx.inner = None
        return (*(torch.zeros_like(x) if g is None and need else g
                  for g, x, need in zip(grads, leaves, ctx.needs_input_grad[:4], strict=True)), None, None, None, None)
