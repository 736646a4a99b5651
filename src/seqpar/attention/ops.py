"""Attention's local computation as opaque ``torch.library`` ops, for calls inside ``torch.compile``.

Traced as it is, the local computation would cut a compiled decoder layer into pieces: its
per-batch planning reads tensors on the host (document rectangles, block plans), the ring's
point-to-point hops are not traceable, and a guard needs Python state. Here each is one op that
dynamo does not look into::

    seqpar::attend            one kernel over the whole sequence (Ulysses), sinks folded in
    seqpar::attend_backward   its backward, from the saved out and lse
    seqpar::ring              the ring loop, its K/V hops inside (p2p or all-gather)
    seqpar::ring_backward     its backward loop, dK/dV hops inside

Their inputs are tensors and constants only: the batch reaches them as its state's ``handle``, a
CPU scalar naming the :class:`~seqpar.attention.shard.BatchState` (its tensors, plans and failure
record: :func:`~seqpar.attention.shard.batch_state`), so a new batch -- of any structure: padded,
packed, permuted -- is a new tensor *value*: no guard fails, nothing recompiles, while its plans
are still made once and kept in its state, exactly as without compilation. Process groups are
found on the mesh the batch was sharded over, by axis name. The kernel is a name of
:data:`~seqpar.attention.kernels.KERNELS` (``"auto"``: the device's varlen lse kernel).

The guard lives inside the ops: a failing kernel gives zeros and is kept in the batch's failure
record, and the ranks raise together at the batch's check (the loss's all-reduce, the end of the
backward: :mod:`seqpar.comm.guard`), as in eager mode. Checked per call (a forward without autograd),
the op's fence runs inside it, right after the local computation, which every rank reaches.

(Written without ``from __future__ import annotations``: ``torch.library`` reads the signatures.)
"""

import torch
from torch import Tensor

from ..comm.guard import Guard
from ..comm.mesh import axis_group, grad_group
from .blocks import fold_sinks, sinks_grad
from .kernel_autograd import placeholder
from .kernels import KERNELS, lse_kernel_for
from .ring_loop import make_ring, pad_to, ring_backward, ring_forward
from .shard import BatchState, batch_state
from .spec import AttnSpec, LseKernel, acc_dtype


def _spec(causal: bool, scale: float | None, window: int | None, softcap: float | None, chunk: int | None) -> AttnSpec:
    return AttnSpec(causal=causal, scale=scale, window=window, softcap=softcap, chunk=chunk)


def _guard(state: BatchState, axes: str, deferred: bool, what: str) -> Guard:
    groups = [axis_group(state.mesh, name) for name in axes.split(",")]
    return Guard(groups, what, batch=state.failures if deferred else None)


def _kernel(name: str, q: Tensor, spec: AttnSpec) -> LseKernel:
    kernel = KERNELS[lse_kernel_for(q.device, q.dtype, spec) if name == "auto" else name]
    assert isinstance(kernel, LseKernel), f"{name!r} is not an lse kernel"
    return kernel


def _no_sinks(q: Tensor) -> Tensor:
    return q.new_empty(0)  # an op returns tensors only: "no d sinks" is an empty one


# --------------------------------------------------------------------------------------------
# one kernel over the whole sequence (Ulysses)
# --------------------------------------------------------------------------------------------

@torch.library.custom_op("seqpar::attend", mutates_args=())
def attend_op(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, handle: Tensor, kernel: str, causal: bool,
              scale: float | None, window: int | None, softcap: float | None, chunk: int | None, axes: str,
              deferred: bool, what: str) -> tuple[Tensor, Tensor]:
    """``(out [B, H, S, Dv], lse [B, H, S])`` of ``q [B, H, S, D]`` against ``k, v [B, H_kv, S, .]``,
    the whole sequence in layout order, under the call's guard; ``sinks [H]`` folded in."""
    state = batch_state(handle)
    spec = _spec(causal, scale, window, softcap, chunk)
    guard = _guard(state, axes, deferred, what)
    res = None
    if q.shape[1]:  # a rank without query heads (more ranks than heads) computes nothing
        res = guard.call(_kernel(kernel, q, spec).forward, q, k, v, spec, state.shard().mask())
    out, lse = res if res is not None else placeholder(q, v)
    if sinks is not None:
        out, lse = fold_sinks(out.to(lse.dtype), lse, sinks)
    guard.fence("forward")
    return out.to(q.dtype).contiguous(), lse.contiguous()


# Every op returns contiguous tensors, and its fake says so: the graph around it is planned on the
# fake's strides (a view of a transposed gradient would fail at run time otherwise).
@attend_op.register_fake
def _(q, k, v, sinks, handle, kernel, causal, scale, window, softcap, chunk, axes, deferred, what):
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


def _contiguous(*xs: Tensor) -> tuple[Tensor, ...]:
    return tuple(x.contiguous() for x in xs)


@torch.library.custom_op("seqpar::attend_backward", mutates_args=())
def attend_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       sinks: Tensor | None, handle: Tensor, kernel: str, causal: bool, scale: float | None,
                       window: int | None, softcap: float | None, chunk: int | None, axes: str, what: str
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, d sinks)`` of :func:`attend_op` from its saved ``out`` and ``lse`` (the folded
    ones: exact, as a ring block's share is); checked once per batch (a backward is autograd's)."""
    state = batch_state(handle)
    spec = _spec(causal, scale, window, softcap, chunk)
    guard = _guard(state, axes, True, what)
    grads = None
    if q.shape[1]:
        grads = guard.call(_kernel(kernel, q, spec).backward, dout, q, k, v, out, lse, spec, state.shard().mask())
    dq, dk, dv = grads if grads is not None else (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else _no_sinks(q)
    guard.fence("backward")
    return _contiguous(dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks)


def _grads_fake(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> tuple[Tensor, ...]:
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            sinks.new_empty(sinks.shape) if sinks is not None else _no_sinks(q))


@attend_backward_op.register_fake
def _(dout, q, k, v, out, lse, sinks, handle, kernel, causal, scale, window, softcap, chunk, axes, what):
    return _grads_fake(q, k, v, sinks)


def _setup(ctx, inputs, output) -> None:
    q, k, v, sinks, handle, *consts = inputs
    # the handle keeps the batch's state (its plans) alive until the backward
    ctx.save_for_backward(q, k, v, *output, sinks, handle)
    ctx.consts = consts[:-2] + consts[-1:]  # the backward is checked once per batch: no `deferred`


def _backward(op, ctx, dout: Tensor):
    q, k, v, out, lse, sinks, handle = ctx.saved_tensors
    dq, dk, dv, dsinks = op(dout.contiguous(), q, k, v, out, lse, sinks, handle, *ctx.consts)
    return dq, dk, dv, dsinks if sinks is not None else None, *([None] * (len(ctx.consts) + 2))


def _attend_backward(ctx, dout: Tensor, _dlse: Tensor):
    return _backward(attend_backward_op, ctx, dout)


attend_op.register_autograd(_attend_backward, setup_context=_setup)


# --------------------------------------------------------------------------------------------
# the ring (ring attention, and hybrid's ring over a ulysses group's heads)
# --------------------------------------------------------------------------------------------

def _ring(state: BatchState, guard: Guard, ring_lens: list[int], ring_axis: str, comm: str, kernel: str,
          spec: AttnSpec):
    shard = state.shard().regrouped(tuple(ring_lens))
    return make_ring(group=axis_group(state.mesh, ring_axis), spec=spec, kernel=KERNELS[kernel], shard=shard,
                     comm=comm, guard=guard, grad_group=grad_group(state.mesh, ring_axis))


@torch.library.custom_op("seqpar::ring", mutates_args=())
def ring_op(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, handle: Tensor, ring_lens: list[int],
            ring_axis: str, comm: str, kernel: str, causal: bool, scale: float | None, window: int | None,
            softcap: float | None, chunk: int | None, axes: str, deferred: bool, what: str) -> tuple[Tensor, Tensor]:
    """The ring's ``(out [B, H, Sq, Dv], lse [B, H, Sq])`` for this rank's queries ``q [B, H, Sq, D]``
    and K/V ``[B, H_kv, Sk, .]`` (:func:`~seqpar.attention.ring_loop.ring_forward`), under the guard."""
    state = batch_state(handle)
    spec = _spec(causal, scale, window, softcap, chunk)
    guard = _guard(state, axes, deferred, what)
    if q.shape[1]:
        ring = _ring(state, guard, ring_lens, ring_axis, comm, kernel, spec)
        out, lse, _, _ = ring_forward(q, k, v, sinks, ring, None)
    else:  # a ulysses rank without query heads: its whole ring group has none, no block travels
        out, lse = placeholder(q, v)
    guard.fence("forward")
    return out.contiguous(), lse.contiguous()


@ring_op.register_fake
def _(q, k, v, sinks, handle, ring_lens, ring_axis, comm, kernel, causal, scale, window, softcap, chunk, axes,
      deferred, what):
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("seqpar::ring_backward", mutates_args=())
def ring_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, sinks: Tensor | None,
                     handle: Tensor, ring_lens: list[int], ring_axis: str, comm: str, kernel: str, causal: bool,
                     scale: float | None, window: int | None, softcap: float | None, chunk: int | None, axes: str,
                     what: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`~seqpar.attention.ring_loop.ring_backward` of :func:`ring_op`: the blocks travel again,
    dK/dV go back to their owners; checked once per batch."""
    state = batch_state(handle)
    spec = _spec(causal, scale, window, softcap, chunk)
    guard = _guard(state, axes, True, what)
    if q.shape[1]:
        ring = _ring(state, guard, ring_lens, ring_axis, comm, kernel, spec)
        kp, vp = pad_to(k, ring.longest), pad_to(v, ring.longest)  # what travelled in the forward
        dq, dk, dv, dsinks = ring_backward(dout, q, kp, vp, out, lse, sinks, ring, k.shape[2], (k.dtype, v.dtype),
                                           sinks is not None)
    else:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dsinks = torch.zeros_like(sinks) if sinks is not None else None
    guard.fence("backward")
    return _contiguous(dq, dk, dv, dsinks if dsinks is not None else _no_sinks(q))


@ring_backward_op.register_fake
def _(dout, q, k, v, out, lse, sinks, handle, ring_lens, ring_axis, comm, kernel, causal, scale, window, softcap,
      chunk, axes, what):
    return _grads_fake(q, k, v, sinks)


def _ring_backward(ctx, dout: Tensor, _dlse: Tensor):
    return _backward(ring_backward_op, ctx, dout)


ring_op.register_autograd(_ring_backward, setup_context=_setup)
