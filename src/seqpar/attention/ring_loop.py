"""The one ring loop: each rank keeps its queries while K/V blocks travel around the ring.

At step ``t`` rank ``r`` holds the K/V block of rank ``(r - t) % P``, attends its queries to it with
a kernel that returns ``(out, lse)``, and merges the partial result into a running ``(out, lse)``
in place (:func:`~seqpar.attention.blocks.merge_into`)::

    step:      0        1        2        3          (P = 4, rank 2)
    K/V from:  r2  ->   r1  ->   r0  ->   r3          block of rank (2 - t) % 4
    queries:   q2       q2       q2       q2          never move

A block's visibility comes from the global positions of its tokens (``SeqShard.positions``), so
nothing here knows the layout; the block plans (skip, trim: :func:`~seqpar.attention.blocks.plan_block`;
fuse: a full or plain-causal block of a batch without padding or documents runs the kernel's fused
op once, no mask, no rectangles: :func:`~seqpar.attention.blocks.fused_plan`) and block masks are
the batch's, made once (:class:`~seqpar.attention.shard.SeqShard`). The
backward sends the blocks around again; each block's dQ/dK/dV come from the kernel's backward with
the *merged* out and lse (the softmax over all keys and sinks), so every block's share is exact.
:func:`ring_forward` and :func:`ring_backward` are that loop in each direction, shared by the
autograd Function here and by the opaque op of compiled regions (:mod:`seqpar.attention.ops`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.guard import Guard, guarded
from .blocks import BlockPlan, RingStats, fold_sinks, fused_plan, merge_into, plan_block, sinks_grad, span_reach
from .ring_comm import COMMS, Grads, RingComm
from .shard import SeqShard
from .spec import AttnSpec, LseKernel, MaskInfo, acc_dtype


@dataclass
class Ring:
    """Everything the ring loop needs besides q, k, v (built once per call)."""

    comm: RingComm
    kernel: LseKernel
    spec: AttnSpec  # without sinks: they are folded after the loop
    shard: SeqShard
    plans: list[BlockPlan | None]  # by owner rank
    longest: int  # K/V travel padded to this length
    guard: Guard | None = None  # local compute under it (None: errors propagate)

    @property
    def me(self) -> int:
        return self.comm.rank

    def mask(self, owner: int, plan: BlockPlan, device: torch.device) -> MaskInfo:
        """The block's MaskInfo, cut to the plan's rows and columns; the batch's (the same tensors
        for every layer and the backward, so the kernel's own plan of the block is reused too)."""
        (r0, nr), (c0, nc) = plan.rows, plan.cols
        rows = (self.shard.local_range(self.me)[0] + r0, nr)
        cols = (self.shard.local_range(owner)[0] + c0, nc)
        return self.shard.mask(rows, cols, device)

    def forward_block(self, q: Tensor, kb: Tensor, vb: Tensor, owner: int, plan: BlockPlan
                      ) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` of this rank's queries against the plan's part of ``owner``'s block: one
        call of the kernel's fused op where the plan says it needs no mask, else its rectangles."""
        (r0, nr), (c0, nc) = plan.rows, plan.cols
        if plan.fused is not None:
            return self.kernel.fused_forward(q[:, :, r0:r0 + nr], kb[:, :, c0:c0 + nc], vb[:, :, c0:c0 + nc],
                                             self.spec, plan.fused == "causal")
        return self.kernel.forward(q[:, :, r0:r0 + nr], kb[:, :, c0:c0 + nc], vb[:, :, c0:c0 + nc], self.spec,
                                   self.mask(owner, plan, q.device))

    def backward_block(self, dout: Tensor, q: Tensor, kb: Tensor, vb: Tensor, out: Tensor, lse: Tensor,
                       owner: int, plan: BlockPlan) -> tuple[Tensor, Tensor, Tensor]:
        """The kernel's ``(dq, dk, dv)`` of the plan's rows and columns, with the merged out and lse."""
        (r0, nr), (c0, nc) = plan.rows, plan.cols
        rows = slice(r0, r0 + nr)
        if plan.fused is not None:
            return self.kernel.fused_backward(dout[:, :, rows], q[:, :, rows], kb[:, :, c0:c0 + nc],
                                              vb[:, :, c0:c0 + nc], out[:, :, rows], lse[:, :, rows], self.spec,
                                              plan.fused == "causal")
        return self.kernel.backward(dout[:, :, rows], q[:, :, rows], kb[:, :, c0:c0 + nc], vb[:, :, c0:c0 + nc],
                                    out[:, :, rows], lse[:, :, rows], self.spec, self.mask(owner, plan, q.device))


def block_plans(shard: SeqShard, spec: AttnSpec, me: int) -> list[BlockPlan | None]:
    """What rank ``me`` computes of every rank's block: host-side arithmetic on the positions, once
    per batch (kept in the shard's state), not per layer. In a batch without padding or documents
    a block that one fused op computes without a mask says so (:attr:`BlockPlan.fused`: every
    block of a zigzag or contiguous causal ring), and runs without the kernel's rectangles."""
    key = ("ring plans", me, spec.causal, spec.window, spec.chunk)
    if key not in shard.cache:
        host = shard if shard.positions is None else SeqShard(shard.seq_lens, shard.positions.cpu(),
                                                              state=shard.state)
        q_pos = host.positions_of(me)
        reach = [_span_reach(shard, spec, me, r) for r in range(len(shard.seq_lens))]
        plans = [plan_block(spec, q_pos, host.positions_of(r), reach[r]) for r in range(len(shard.seq_lens))]
        if shard.key_keep is None and shard.segments is None:
            plans = [fused_plan(spec, p, q_pos, host.positions_of(r), reach[r] is not None)
                     for r, p in enumerate(plans)]
        shard.cache[key] = plans
    return shard.cache[key]


def _span_reach(shard: SeqShard, spec: AttnSpec, me: int, owner: int) -> tuple[Tensor, Tensor] | None:
    """:func:`~seqpar.attention.blocks.span_reach` of rank ``me``'s queries against ``owner``'s
    keys (None: no span adds a pair there -- no spans, not causal, or none shared)."""
    if shard.blocks is None or not spec.causal:
        return None
    (a, n), (c, m) = shard.local_range(me), shard.local_range(owner)
    rows, cols = span_reach(shard.positions_of(me).cpu(), shard.positions_of(owner).cpu(),
                            shard.blocks[:, a:a + n], shard.blocks[:, c:c + m])
    return (rows, cols) if bool(rows.any()) and bool(cols.any()) else None


def make_ring(*, group: dist.ProcessGroup, spec: AttnSpec, kernel: LseKernel, shard: SeqShard, comm: str,
              guard: Guard | None = None, grad_group: dist.ProcessGroup | None = None) -> Ring:
    """The :class:`Ring` of one call (``spec`` may carry sinks: the loop's kernel sees it without)."""
    ring_comm = COMMS[comm](group, grad_group)
    plain = replace(spec, sinks=None)
    return Ring(ring_comm, kernel, plain, shard, block_plans(shard, plain, ring_comm.rank), max(shard.seq_lens),
                guard)


def pad_to(x: Tensor, n: int) -> Tensor:
    """``[B, H, S, D] -> [B, H, n, D]`` with zeros (the block shape every rank sends; k and v may
    have different D)."""
    if x.shape[2] == n:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((*x.shape[:2], n - x.shape[2], x.shape[3]))], dim=2)


def ring_forward(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, ring: Ring, stats: RingStats | None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward loop: ``(out [B, H, Sq, Dv], lse [B, H, Sq], kp, vp)`` -- out in q's dtype with
    sinks folded in, lse in the accumulation dtype, and the padded K/V that travelled (what the
    backward sends again). q ``[B, H, Sq, D]``, k ``[B, H_kv, Sk, D]``, v ``[B, H_kv, Sk, Dv]``."""
    acc = acc_dtype(q.dtype)
    out = q.new_zeros((*q.shape[:3], v.shape[3]), dtype=acc)  # [B, H, Sq, Dv]
    lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc)  # [B, H, Sq]
    kp, vp = pad_to(k, ring.longest), pad_to(v, ring.longest)  # [B, H_kv, L, D]: what travels
    for owner, kb, vb in ring.comm.blocks(kp, vp):
        plan = ring.plans[owner]
        if plan is None:
            if stats is not None:
                stats.skipped += 1
            continue
        res = guarded(ring.guard, ring.forward_block, q, kb, vb, owner, plan)
        if res is None:  # this rank failed: keep the blocks moving for the others, compute nothing
            continue
        rows = slice(plan.rows[0], plan.rows[0] + plan.rows[1])
        merge_into(out[:, :, rows], lse[:, :, rows], *res)
        if stats is not None:
            stats.add(plan)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out.to(q.dtype), lse, kp, vp


def ring_backward(dout: Tensor, q: Tensor, kp: Tensor, vp: Tensor, out: Tensor, lse: Tensor, sinks: Tensor | None,
                  ring: Ring, n: int, kv_dtypes: tuple[torch.dtype, torch.dtype], need_dsinks: bool
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The backward loop: ``(dq, dk, dv, dsinks)`` from the forward's merged ``out`` and ``lse`` and
    the padded K/V ``kp``, ``vp``; dk, dv cut back to this rank's ``n`` tokens."""
    dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
    # dK/dV accumulate in float32 (float64) while they travel: P partial sums per block, added
    # in place into the accumulator that arrives with each block (no per-step allocation)
    sink = ring.comm.grad_sink(kp, vp, lse.dtype)
    grads: Grads = None
    for t, (owner, kb, vb) in enumerate(ring.comm.blocks(kp, vp)):
        if t > 0:  # the previous block's dK/dV leave after the K/V hop this step posted, never before it
            sink.push(grads)
        plan = ring.plans[owner]
        g = None if plan is None else guarded(ring.guard, ring.backward_block, dout, q, kb, vb, out, lse, owner, plan)
        grads = None  # skipped or failed: the accumulator passes on unchanged
        if g is not None:
            (r0, nr), cols = plan.rows, plan.cols
            dq[:, :, r0:r0 + nr] += g[0]
            grads = (cols, g[1], g[2])  # dK, dV of the plan's columns of the block
    sink.push(grads)
    dk, dv = sink.result()
    dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and need_dsinks else None
    return dq.to(q.dtype), dk[:, :, :n].to(kv_dtypes[0]), dv[:, :, :n].to(kv_dtypes[1]), dsinks


class _RingAttention(torch.autograd.Function):
    """Forward: :func:`ring_forward`. Backward: :func:`ring_backward` -- the blocks travel again, dQ
    stays, dK/dV go back to the block's owner. Layouts: q [B, H, Sq, D], k [B, H_kv, Sk, D],
    v [B, H_kv, Sk, Dv] (this rank's tokens), sinks [H] or None."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, ring: Ring, stats: RingStats | None):
        out, lse, kp, vp = ring_forward(q, k, v, sinks, ring, stats)
        ctx.save_for_backward(q, kp, vp, out, lse, sinks)
        ctx.ring, ctx.n, ctx.kv_dtypes = ring, k.shape[2], (k.dtype, v.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kp, vp, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = ring_backward(dout, q, kp, vp, out, lse, sinks, ctx.ring, ctx.n, ctx.kv_dtypes,
                                           ctx.needs_input_grad[3])
        return dq, dk, dv, dsinks, None, None


def run_ring(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, spec: AttnSpec, kernel: LseKernel,
             shard: SeqShard, comm: str, stats: RingStats | None = None, guard: Guard | None = None,
             grad_group: dist.ProcessGroup | None = None) -> Tensor:
    """The ring on validated inputs: ``[B, S_local, H, D] -> [B, S_local, H, Dv]`` (contiguous).

    ``spec.sinks`` (``[H]``, the heads of ``q``) are folded in; the kernel sees the spec without
    them. With ``guard`` the local compute runs under it and the caller fences.
    """
    ring = make_ring(group=group, spec=spec, kernel=kernel, shard=shard, comm=comm, guard=guard,
                     grad_group=grad_group)
    out = _RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec.sinks, ring, stats)
    return out.transpose(1, 2).contiguous()  # [B, S_local, H, Dv]
