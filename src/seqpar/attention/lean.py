"""Ulysses' exchange and local lse kernel as one autograd step that keeps no gathered output.

The plain path (:mod:`.run`: heads_to_seq, the kernel's autograd, seq_to_heads) saves the kernel's
output ``out [B, S, H/P, Dv]`` for its backward: one whole-sequence tensor per attention layer, next
to the layer's own ``[B, S/P, H, Dv]`` output that the model's output projection saves anyway. Here
the backward gets the gathered output back by sending that local output again -- one more exchange,
before the gradient's -- so nothing whole-sequence is kept but q, k, v and the log-sum-exp
(diffusers' Ulysses keeps q, k, v and recomputes the attention in its backward instead)::

    forward   q, k, v  # [B, S/P, H, D]  -> all-to-all -> [B, S, H/P, D]   saved, with lse [B, H/P, S]
              kernel forward -> out [B, S, H/P, Dv] -> all-to-all -> out_local [B, S/P, H, Dv]   saved
    backward  out_local -> all-to-all -> out, then d out_local -> all-to-all -> d out   [B, S, H/P, Dv]
              kernel backward (out bit for bit the forward's) -> dq, dk, dv -> all-to-all back, one
              at a time (each freed once sent: the backward's peak holds one exchange's buffers)

Used for plain multi-head attention (as many KV heads as query heads, every rank holding at least
one head, no sinks) with a kernel that returns the log-sum-exp, outside ``torch.compile``
(:func:`applies`); any other call takes the plain path.

The local output is kept only while the model keeps it too (an output projection saves its input: the
same storage). A caller that knows the model will not -- the attention's output concatenated into a
new tensor right away (Flux's single-stream blocks) -- calls :func:`release` on it: the backward then
recomputes the kernel's forward from the saved q, k, v instead (diffusers' choice for every layer).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import all_to_all_multi, even_ranges, split_offsets
from ..comm.guard import Guard
from .kernel_autograd import placeholder
from .spec import AttnSpec, Kernel, LseKernel, MaskInfo


def applies(kernel: Kernel, spec: AttnSpec, q: Tensor, k: Tensor, group: dist.ProcessGroup) -> bool:
    """Whether a Ulysses call over ``group`` takes this path (see the module doc)."""
    return (isinstance(kernel, LseKernel) and spec.sinks is None and k.shape[2] == q.shape[2]
            and q.shape[2] >= dist.get_world_size(group) and not torch.compiler.is_compiling())


def _t(x: Tensor) -> Tensor:
    return x.transpose(1, 2)  # [B, S, H, D] <-> [B, H, S, D]


class _LeanUlysses(torch.autograd.Function):
    """Forward: all-to-all q, k, v to the whole sequence, the kernel, all-to-all the output back.
    Backward: an all-to-all of the output itself (rather than a saved gathered copy; recomputed when
    released), one of its gradient, the kernel's backward, one of dq, dk, dv back: every exchange the
    reverse of a forward one, so each rank's gradient lands on the tokens and heads it sent. Under
    the guard a failing kernel gives zeros and the last exchange of each direction carries the flag."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo, kernel: LseKernel,
                guard: Guard, group: dist.ProcessGroup, lens: tuple[int, ...]) -> Tensor:
        p = dist.get_world_size(group)
        heads = even_ranges(q.shape[2], p)  # [(start, n)] per rank: this call's head split
        seqs = list(zip(split_offsets(lens), lens, strict=True))
        flags = len(guard.groups) == 1
        qh, kh, vh = all_to_all_multi([q, k, v], scatter_dim=2, gather_dim=1, group=group,
                                      send_ranges=[heads] * 3, recv_sizes=[lens] * 3)  # [B, S, H/P, D]
        res = guard.call(kernel.forward, _t(qh), _t(kh), _t(vh), spec, mask)
        out, lse = res if res is not None else placeholder(_t(qh), _t(vh))  # [B, H/P, S, Dv], [B, H/P, S]
        local = all_to_all_multi([_t(out).to(q.dtype)], scatter_dim=1, gather_dim=2, group=group,
                                 send_ranges=[seqs], recv_sizes=[[n for _, n in heads]],
                                 flag=guard.flag("forward") if flags else None)[0]  # [B, S/P, H, Dv]
        ctx.save_for_backward(qh, kh, vh)
        # kept for the backward unless released (both dropped then: the recompute makes them again); the
        # output as a detached view -- the same storage, no grad_fn, so no reference cycle
        ctx.kept, ctx.lse = local.detach(), lse
        ctx.spec, ctx.mask, ctx.kernel, ctx.guard, ctx.group = spec, mask, kernel, guard, group
        ctx.lens, ctx.heads, ctx.seqs, ctx.flags = lens, heads, seqs, flags
        return local

    @staticmethod
    def backward(ctx, dlocal: Tensor):
        qh, kh, vh = ctx.saved_tensors
        group, heads, lens, local, lse = ctx.group, ctx.heads, ctx.lens, ctx.kept, ctx.lse
        ctx.kept = ctx.lse = None
        # the output travels first, on its own: its send copy is gone before the gradient's is made (one
        # exchange more, so that the backward's peak holds no more than a recompute's would)
        out = None if local is None else all_to_all_multi([local], scatter_dim=2, gather_dim=1, group=group,
                                                          send_ranges=[heads], recv_sizes=[lens])[0]
        del local
        dout = all_to_all_multi([dlocal], scatter_dim=2, gather_dim=1, group=group, send_ranges=[heads],
                                recv_sizes=[lens])[0]  # [B, S, H/P, Dv]
        if out is None:  # released: the forward again, bit for bit the same output and lse
            res = ctx.guard.call(ctx.kernel.forward, _t(qh), _t(kh), _t(vh), ctx.spec, ctx.mask)
            out, lse = res if res is not None else placeholder(_t(qh), _t(vh))  # [B, H/P, S, Dv]
            out = _t(out).to(qh.dtype)
        grads = ctx.guard.call(ctx.kernel.backward, _t(dout), _t(qh), _t(kh), _t(vh), _t(out), lse, ctx.spec,
                               ctx.mask)
        del dout, out  # [B, S, H/P, Dv] each: freed before the exchange back allocates its buffers
        dq, dk, dv = (_t(g) for g in grads) if grads is not None else (torch.zeros_like(x) for x in (qh, kh, vh))
        counts = [n for _, n in heads]
        grads_g = [dq, dk, dv]  # [B, S, H/P, D]
        del dq, dk, dv, grads
        back = []
        while grads_g:  # one tensor per exchange, each whole-sequence gradient freed once sent: the peak
            g = grads_g.pop(0)  # holds one exchange's buffers, not three (two exchanges more per layer)
            flag = ctx.guard.flag("backward") if ctx.flags and not grads_g else None  # on the last one
            back.append(all_to_all_multi([g.to(qh.dtype)], scatter_dim=1, gather_dim=2, group=group,
                                         send_ranges=[ctx.seqs], recv_sizes=[counts], flag=flag)[0])
            del g
        return (*back, None, None, None, None, None, None)


def release(out: Tensor) -> bool:
    """Let the backward of the call that made ``out`` recompute its gathered output instead of keeping
    ``out`` alive (see the module doc); True if ``out`` came from this path (else nothing to do)."""
    node = out.grad_fn
    if node is None or getattr(node, "kept", None) is None:
        return False
    node.kept = node.lse = None
    return True


def lean_ulysses(q: Tensor, k: Tensor, v: Tensor, *, spec: AttnSpec, mask: MaskInfo, kernel: LseKernel, guard: Guard,
                 group: dist.ProcessGroup, lens: list[int]) -> Tensor:
    """Ulysses' local step on ``q, k, v [B, S/P, H, D]`` -> ``[B, S/P, H, Dv]`` (see the module doc)."""
    return _LeanUlysses.apply(q, k, v, spec, mask, kernel, guard, group, tuple(lens))
