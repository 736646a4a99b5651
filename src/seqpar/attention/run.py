"""The one body of every attention call: its guard, Ulysses' exchange where heads are split, the local
computation (one kernel over the whole sequence, or the ring), and the fence::

    guard.inputs(q, k, v, sinks)                       the backward's fence sits here (per call)
    [heads_to_seq over the ulysses group]              Ulysses, hybrid (not over one rank); Ulysses
                                                       with an lse kernel: .lean (no gathered output kept)
      local: attend(kernel, the batch's mask)          Ulysses
             ring loop over the ring group             ring, hybrid (a ring x ulysses grid)
    [seq_to_heads over the ulysses group]
    guard.fence("forward")

A call whose groups hold this rank alone (a dynamic SP schedule's degree-1 bin,
:mod:`seqpar.comm.degrees`) has the whole sequence here: it runs the local attention on it directly,
with no exchange, no ring and none of their copies -- the computation Ulysses would run after a
one-rank all-to-all.

A rank whose local compute raises sends zeros on, and every rank raises at the fences: per call,
or once per batch for a batch's SeqShard under autograd (:mod:`seqpar.comm.guard`). Inside
``torch.compile`` the same body runs traced: the all-to-alls as functional collectives, the local
computation and its guard inside opaque ops (:mod:`seqpar.attention.ops`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.guard import Guard
from . import lean, ops
from .call import AttnCall
from .heads import heads_to_seq, idle_output, local_heads, seq_to_heads
from .kernels import KERNELS, attend
from .ring_loop import run_ring
from .spec import AttnSpec, LocalKernel


def run(call: AttnCall, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The call on validated inputs ``q [B, S_local, H, D]``, ``k [B, S_local, H_kv, D]``,
    ``v [B, S_local, H_kv, Dv]``: a contiguous ``[B, S_local, H, Dv]``."""
    if torch.compiler.is_compiling():
        kernel = op_kernel(call)
        if kernel is None:  # a call the ops cannot take: run it as it runs eagerly (a graph break)
            return _run_eagerly(call, q, k, v)
        return _traced(call, kernel, q, k, v)
    return _eager(call, q, k, v)


def _eager(call: AttnCall, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    guard = call.guard()
    q, k, v, sinks = guard.inputs(q, k, v, call.spec.sinks)
    spec = replace(call.spec, sinks=sinks)
    if alone(call):
        out = _local(call, q, k, v, spec, guard)  # [B, S, H, Dv]
    elif call.groups.ulysses is None:
        out = _ring(call, q, k, v, spec, guard)  # [B, S/P, H, Dv]
    else:
        out = _exchanged(call, q, k, v, spec, guard)
    guard.fence("forward")
    return out


def alone(call: AttnCall) -> bool:
    """Whether every group of ``call`` is this rank alone (nothing to exchange); a ring collecting
    stats (:class:`~seqpar.attention.blocks.RingStats`) still runs its loop, which records them."""
    return call.groups.sizes == (1, 1) and call.stats is None


def _local(call: AttnCall, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, guard: Guard) -> Tensor:
    """The whole sequence's attention on this rank ``[B, S, H, D] -> [B, S, H, Dv]`` (contiguous)."""
    return attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec, call.mask(), call.kernel,
                  guard).transpose(1, 2).contiguous()


def _exchanged(call: AttnCall, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, guard: Guard) -> Tensor:
    """Ulysses' exchange around the local computation on this rank's heads."""
    group = call.groups.ulysses
    me, lens = dist.get_rank(group), call.ulysses_lens()
    if call.groups.ring is None and lean.applies(call.kernel, spec, q, k, group):  # no gathered output kept
        return lean.lean_ulysses(q, k, v, spec=spec, mask=call.mask(), kernel=call.kernel, guard=guard, group=group,
                                 lens=lens)
    # a guard of one group hears every rank's failure in the last exchange of each direction: no fence
    # collective unless a rank failed (checked once per batch: no flag, nothing read)
    flags = len(guard.groups) == 1
    qh, kh, vh, q_ranges = heads_to_seq(q, k, v, group=group, seq_lens=lens,
                                        flag=guard.flag("backward") if flags else None)  # [B, S, H/P, D]
    if q_ranges[me][1] == 0:  # more ranks than query heads: nothing to compute here
        out = idle_output(qh, kh, vh, spec.sinks)
    else:
        mine = local_heads(spec, q_ranges[me])
        if call.groups.ring is not None:
            out = _ring(call, qh, kh, vh, mine, guard)
        else:
            out = attend(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2), mine, call.mask(), call.kernel,
                         guard).transpose(1, 2)  # [B, S, H/P, Dv]
    return seq_to_heads(out, group=group, seq_lens=lens, q_ranges=q_ranges,
                        flag=guard.flag("forward") if flags else None)  # [B, S/P, H, Dv]


def _ring(call: AttnCall, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, guard: Guard) -> Tensor:
    return run_ring(q, k, v, group=call.groups.ring, spec=spec, kernel=call.kernel, shard=call.ring_shard(),
                    comm=call.comm, stats=call.stats, guard=guard, grad_group=call.groups.ring_grad)


_run_eagerly = torch.compiler.disable(_eager)


def op_kernel(call: AttnCall) -> str | None:
    """The name the ops run ``call``'s kernel by (:mod:`seqpar.attention.ops`), or None when a
    compiled region cannot run the call inside them: its process groups did not come from the mesh
    its batch was sharded over (the ops find them there), it collects ring stats, or its kernel is
    neither a registered lse kernel nor has one as its twin (:meth:`LocalKernel.lse_twin`)."""
    state = call.shard.state
    if state.mesh is None or call.groups.mesh is not state.mesh or call.stats is not None:
        return None
    kernel = call.kernel
    if isinstance(kernel, LocalKernel):
        return kernel.lse_twin(call.spec)
    return kernel.name if KERNELS.get(kernel.name) is kernel else None


def _traced(call: AttnCall, kernel: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """:func:`_eager`'s body for ``torch.compile`` to trace: the all-to-alls as functional
    collectives, the local computation and its guard inside an op (no Python state, no graph break)."""
    shard, spec, (u_axis, r_axis) = call.shard, call.spec, call.groups.axes
    handle = shard.handle
    guard = (",".join(a for a in (u_axis, r_axis) if a is not None), call.batch is not None, call.what)
    options = (kernel, spec.causal, spec.scale, spec.window, spec.softcap, spec.chunk)

    def local(qh: Tensor, kh: Tensor, vh: Tensor, mine: AttnSpec) -> Tensor:  # [B, S, H', D] -> [B, S, H', Dv]
        qh, kh, vh = (t.transpose(1, 2) for t in (qh, kh, vh))
        if r_axis is None:
            out, _ = ops.attend_op(qh, kh, vh, mine.sinks, handle, *options, *guard)
        else:
            out, _ = ops.ring_op(qh, kh, vh, mine.sinks, handle, list(call.ring_lens()), r_axis, call.comm, *options,
                                 *guard)
        return out.transpose(1, 2)

    if u_axis is None or (r_axis is None and alone(call)):
        return local(q, k, v, spec).contiguous()
    group = call.groups.ulysses
    lens = call.ulysses_lens()
    qh, kh, vh, q_ranges = heads_to_seq(q, k, v, group=group, seq_lens=lens)  # [B, S, H/P, D]
    out = local(qh, kh, vh, local_heads(spec, q_ranges[dist.get_rank(group)]))  # no heads: the op computes nothing
    return seq_to_heads(out, group=group, seq_lens=lens, q_ranges=q_ranges)  # [B, S/P, H, Dv]
