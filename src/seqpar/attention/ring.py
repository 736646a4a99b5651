"""Ring attention: each rank keeps its queries while K/V blocks travel around the ring.

One loop serves every variant. At step ``t`` rank ``r`` holds the K/V block of rank ``(r - t) % P``,
attends its queries to it with a kernel that returns ``(out, lse)``, and merges the partial result
into a running ``(out, lse)`` in place (:func:`~seqpar.attention.blocks.merge_into`)::

    step:      0        1        2        3          (P = 4, rank 2)
    K/V from:  r2  ->   r1  ->   r0  ->   r3          block of rank (2 - t) % 4
    queries:   q2       q2       q2       q2          never move

Layouts (contiguous, zigzag) are token permutations: a block's causal / window visibility comes
from the global positions of its tokens (``SeqShard.positions``), so nothing in the loop knows the
layout. The positions, padding mask and segment ids of every block are batch-level facts already in
the :class:`SeqShard` on every rank, so only K and V travel. A block that causal/window hide entirely
is skipped, and a partly hidden one is trimmed to the bounding box of its visible pairs (with zigzag
this halves every off-diagonal block and removes its mask).

How K/V travel is a small swappable object (:mod:`seqpar.attention.ring_comm`): ``"p2p"`` (one hop per
step, the next block's transfer overlapping this block's compute; backward sends dK/dV one step
behind, so each returns to its owner; no rank ever holds more than two K/V blocks) or
``"allgather"`` (gather K/V once; the backward reduce-scatters dK/dV). Unequal local lengths travel
padded to the longest shard (at most a few tokens with tensor_split-style splits); the padding is
never attended.

Attention sinks are one more partial result, folded into the merged ``(out, lse)`` after the loop
(:func:`seqpar.attention.blocks.fold_sinks`); the backward then uses the folded ones, and each
rank's d sinks covers its own queries. The local compute runs under a
:class:`~seqpar.comm.guard.Guard`: a rank whose kernel raises keeps passing blocks on without
computing, and every rank raises at the fence after the loop (forward) or at the inputs (backward)
-- or, for a batch's SeqShard under autograd, at the batch's check (:mod:`seqpar.comm.guard`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.guard import Guard, guarded
from ..errors import Refused
from .blocks import BlockPlan, RingStats, fold_sinks, merge_into, plan_block, sinks_grad
from .kernels import KernelArg, lse_kernel
from .layout import layout_permutation, layout_seq_lens
from .ring_comm import COMMS, Grads, RingComm
from .shard import SeqShard, deferred_check, shard_cache, with_global_masks
from .spec import AttnSpec, LseKernel, MaskInfo, acc_dtype, check_supported
from .validate import shard_lengths

# --------------------------------------------------------------------------------------------
# the ring
# --------------------------------------------------------------------------------------------

@dataclass
class _Ring:
    """Everything the ring loop needs besides q, k, v (built once per call)."""

    comm: RingComm
    kernel: LseKernel
    spec: AttnSpec
    shard: SeqShard
    plans: list[BlockPlan | None]  # by owner rank
    longest: int  # K/V travel padded to this length
    guard: Guard | None = None  # local compute under it (None: errors propagate)

    def mask(self, owner: int, plan: BlockPlan, me: int, device: torch.device) -> MaskInfo:
        """The block's MaskInfo, cut to the plan's rows and columns (global positions); built once
        per batch (the same tensors for every layer and the backward, so the kernel's own plan of
        the block is reused too)."""
        key = ("ring mask", owner, me, plan.rows, plan.cols, device)
        cache = shard_cache(self.shard)
        if key not in cache:
            cache[key] = self._mask(owner, plan, me, device)
        return cache[key]

    def _mask(self, owner: int, plan: BlockPlan, me: int, device: torch.device) -> MaskInfo:
        (r0, nr), (c0, nc) = plan.rows, plan.cols
        qs, ks = self.shard.local_range(me)[0] + r0, self.shard.local_range(owner)[0] + c0
        keep, seg = self.shard.key_keep, self.shard.segments
        return MaskInfo(
            q_pos=self.shard.positions_of(me, r0, nr).to(device),
            k_pos=self.shard.positions_of(owner, c0, nc).to(device),
            key_keep=keep[:, ks:ks + nc] if keep is not None else None,
            q_seg=seg[:, qs:qs + nr] if seg is not None else None,
            k_seg=seg[:, ks:ks + nc] if seg is not None else None)


    def forward_block(self, q: Tensor, kb: Tensor, vb: Tensor, owner: int, plan: BlockPlan, me: int
                      ) -> tuple[Tensor, Tensor]:
        """``(out, lse)`` of this rank's queries against the plan's part of ``owner``'s block."""
        (r0, nr), (c0, nc) = plan.rows, plan.cols
        return self.kernel.forward(q[:, :, r0:r0 + nr], kb[:, :, c0:c0 + nc], vb[:, :, c0:c0 + nc], self.spec,
                                   self.mask(owner, plan, me, q.device))

    def backward_block(self, dout: Tensor, q: Tensor, kb: Tensor, vb: Tensor, out: Tensor, lse: Tensor,
                       owner: int, plan: BlockPlan, me: int) -> tuple[Tensor, Tensor, Tensor]:
        """The kernel's ``(dq, dk, dv)`` of the plan's rows and columns, with the merged out and lse."""
        (r0, nr), (c0, nc) = plan.rows, plan.cols
        rows = slice(r0, r0 + nr)
        return self.kernel.backward(dout[:, :, rows], q[:, :, rows], kb[:, :, c0:c0 + nc], vb[:, :, c0:c0 + nc],
                                    out[:, :, rows], lse[:, :, rows], self.spec, self.mask(owner, plan, me, q.device))


def _pad(x: Tensor, n: int) -> Tensor:
    """``[B, H, S, D] -> [B, H, n, D]`` with zeros (the block shape every rank sends; k and v may
    have different D)."""
    if x.shape[2] == n:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((*x.shape[:2], n - x.shape[2], x.shape[3]))], dim=2)


class _RingAttention(torch.autograd.Function):
    """Forward: K/V blocks travel the ring, each merged into (out, lse); sinks folded in at the end.
    Backward: the blocks travel again; each block's dQ/dK/dV come from the kernel's backward with
    the *merged* out and lse (the softmax over all keys and sinks, so every block's share is
    exact), dQ stays, dK/dV go back to the block's owner. Layouts: q [B, H, Sq, D],
    k [B, H_kv, Sk, D], v [B, H_kv, Sk, Dv] (this rank's tokens), sinks [H] or None."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, ring: _Ring, me: int, stats: RingStats | None):
        acc = acc_dtype(q.dtype)
        out = q.new_zeros((*q.shape[:3], v.shape[3]), dtype=acc)  # [B, H, Sq, Dv]
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc)  # [B, H, Sq]
        kp, vp = _pad(k, ring.longest), _pad(v, ring.longest)  # [B, H_kv, L, D]: what travels, kept for backward
        for owner, kb, vb in ring.comm.blocks(kp, vp):
            plan = ring.plans[owner]
            if plan is None:
                if stats is not None:
                    stats.skipped += 1
                continue
            res = guarded(ring.guard, ring.forward_block, q, kb, vb, owner, plan, me)
            if res is None:  # this rank failed: keep the blocks moving for the others, compute nothing
                continue
            rows = slice(plan.rows[0], plan.rows[0] + plan.rows[1])
            merge_into(out[:, :, rows], lse[:, :, rows], *res)
            if stats is not None:
                stats.blocks += 1
                stats.visible_pairs += plan.visible
                stats.computed_pairs += plan.rows[1] * plan.cols[1]
        if sinks is not None:
            out, lse = fold_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kp, vp, out, lse, sinks)
        ctx.ring, ctx.me, ctx.n, ctx.kv_dtypes = ring, me, k.shape[2], (k.dtype, v.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kp, vp, out, lse, sinks = ctx.saved_tensors
        ring, me = ctx.ring, ctx.me
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        # dK/dV accumulate in float32 (float64) while they travel: P partial sums per block, added
        # in place into the accumulator that arrives with each block (no per-step allocation)
        sink = ring.comm.grad_sink(kp, vp, lse.dtype)
        grads: Grads = None
        for t, (owner, kb, vb) in enumerate(ring.comm.blocks(kp, vp)):
            if t > 0:  # the previous block's dK/dV leave after the K/V hop this step posted, never before it
                sink.push(grads)
            plan = ring.plans[owner]
            g = None if plan is None else guarded(ring.guard, ring.backward_block, dout, q, kb, vb, out, lse,
                                                  owner, plan, me)
            grads = None  # skipped or failed: the accumulator passes on unchanged
            if g is not None:
                (r0, nr), cols = plan.rows, plan.cols
                dq[:, :, r0:r0 + nr] += g[0]
                grads = (cols, g[1], g[2])  # dK, dV of the plan's columns of the block
        sink.push(grads)
        dk, dv = sink.result()
        n, (k_dtype, v_dtype) = ctx.n, ctx.kv_dtypes
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk[:, :, :n].to(k_dtype), dv[:, :, :n].to(v_dtype), dsinks, None, None, None


def run_ring(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, spec: AttnSpec, kernel: LseKernel,
             shard: SeqShard, comm: str, stats: RingStats | None = None, guard: Guard | None = None,
             grad_group: dist.ProcessGroup | None = None) -> Tensor:
    """The ring on validated inputs: ``[B, S_local, H, D] -> [B, S_local, H, Dv]`` (contiguous).

    ``spec.sinks`` (``[H]``, the heads of ``q``) are folded in; the kernel sees the spec without
    them. With ``guard`` the local compute runs under it and the caller fences.
    """
    me = dist.get_rank(group)
    # block planning is host-side arithmetic: once per batch (the shard), not per layer
    key = ("ring plans", me, spec.causal, spec.window, spec.chunk)
    cache = shard_cache(shard)
    if key not in cache:
        host = shard if shard.positions is None else replace(shard, positions=shard.positions.cpu())
        q_pos = host.positions_of(me)
        cache[key] = [plan_block(spec, q_pos, host.positions_of(r)) for r in range(len(shard.seq_lens))]
    plans = cache[key]
    ring = _Ring(COMMS[comm](group, grad_group), kernel, replace(spec, sinks=None), shard, plans, max(shard.seq_lens),
                 guard)
    out = _RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec.sinks, ring, me, stats)
    return out.transpose(1, 2).contiguous()  # [B, S_local, H, Dv]


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, causal: bool = False,
    scale: float | None = None, window: int | None = None, softcap: float | None = None,
    chunk: int | None = None, sinks: Tensor | None = None,
    dropout: float = 0.0, kernel: KernelArg | None = None, key_padding_mask: Tensor | None = None,
    segment_ids: Tensor | None = None, shard: SeqShard | None = None, layout: str | None = None,
    comm: str = "p2p", validate: bool = True, stats: RingStats | None = None,
    grad_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Exact attention over the whole sequence from sequence shards, K/V travelling around a ring.

    Args:
        q: ``[B, S_local, H, D]``; k: ``[B, S_local, H_kv, D]``; v: ``[B, S_local, H_kv, Dv]`` --
            this rank's tokens, in the layout's order (see :mod:`seqpar.attention.layout`). Local
            lengths may differ between ranks.
        group: the ring's process group.
        causal, scale, window, chunk, softcap: see :class:`seqpar.attention.spec.AttnSpec`.
            ``dropout`` must be 0.
        sinks: ``[H]`` attention-sink logits (GPT-OSS), the same on every rank; may require grad:
            each rank's gradient covers its own queries, so their sum over the ring is the total.
        kernel: a kernel returning ``(out, lse)`` with a backward: ``"auto"`` (default:
            ``flash_cpu`` on CPU, ``cuda_flash`` on CUDA, ``tiled`` for softcap and elsewhere -- all
            varlen, no ``S x S`` mask), any of them by name, ``"reference"`` or a Kernel object.
        key_padding_mask, segment_ids: this rank's ``[B, S_local]`` padding mask (True = real token)
            and packed-document ids (one small all-gather); or pass ``shard`` to reuse global ones.
        shard: batch-level :class:`SeqShard`; its ``positions`` say which global token each rank holds.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"doc-zigzag"`` (balanced per packed document:
            needs the batch's ``shard``, from :func:`seqpar.shard_batch`); without a shard it says
            which tokens each rank holds (:func:`seqpar.attention.layout.layout_indices`); with one it must
            agree with the shard.
            None: the shard's layout, else contiguous.
        comm: ``"p2p"`` (K/V pass from rank to rank, overlapped) or ``"allgather"`` (gathered once).
        validate: check inputs across ranks first (one small all-gather); without it ``shard`` gives
            the lengths (else all ranks are assumed to hold ``S_local`` tokens).
        stats: a :class:`RingStats` to add this rank's forward work to.
        grad_group: a second group over ``group``'s ranks (same order) for the backward's dK/dV
            hops, so they do not queue behind K/V hops (:func:`seqpar.init_mesh` makes one per ring
            axis; :func:`seqpar.sp_attention` passes it). Default: ``group``.

    Returns a contiguous ``[B, S_local, H, Dv]``. Raises ValueError (on every rank) for
    inconsistent inputs; an exception in one rank's kernel is raised on every rank (see
    :mod:`seqpar.comm.guard`: one tiny all-gather per call and direction, or once per batch when
    ``shard`` is the batch's and autograd is on).
    """
    spec = AttnSpec(causal=causal, scale=scale, window=window, softcap=softcap, chunk=chunk, sinks=sinks)
    kern = ring_options(q, spec, kernel=kernel, dropout=dropout, comm=comm, shard=shard,
                        masks_given=key_padding_mask is not None or segment_ids is not None)
    check_grad_group(group, grad_group)
    p = dist.get_world_size(group)
    if shard is not None and len(shard.seq_lens) != p:
        raise ValueError(f"the SeqShard has {len(shard.seq_lens)} shard lengths for a ring of {p} ranks: build it"
                         " over this group")
    seq_lens = shard_lengths(q, k, v, group=group, spec=spec, key_padding_mask=key_padding_mask,
                             segment_ids=segment_ids, shard=shard, validate=validate)
    check_supported(kern, spec)  # after the cross-rank check: the spec is the same everywhere now
    batch = deferred_check(shard, q, k, v, sinks)
    shard = resolve_shard(shard, tuple(seq_lens), layout, p)
    shard = with_global_masks(shard, key_padding_mask, segment_ids, group)
    guard = Guard([group], "ring attention", batch=batch)
    q, k, v, sinks = guard.inputs(q, k, v, sinks)
    out = run_ring(q, k, v, group=group, spec=replace(spec, sinks=sinks), kernel=kern, shard=shard, comm=comm,
                   stats=stats, guard=guard, grad_group=grad_group)
    guard.fence("forward")
    return out


def check_grad_group(group: dist.ProcessGroup, grad_group: dist.ProcessGroup | None) -> None:
    """A ring's ``grad_group`` must hold ``group``'s ranks in the same order (dK/dV go back to the
    rank that owns the block). Local: the same answer on every rank, before any collective."""
    if grad_group is not None and dist.get_process_group_ranks(grad_group) != dist.get_process_group_ranks(group):
        raise ValueError(f"grad_group holds ranks {dist.get_process_group_ranks(grad_group)} but the ring's group "
                         f"{dist.get_process_group_ranks(group)}: pass a group over the same ranks in the same order "
                         "(seqpar.init_mesh makes one), or omit grad_group")


def ring_options(q: Tensor, spec: AttnSpec, *, kernel: KernelArg | None, dropout: float, comm: str,
                 shard: SeqShard | None, masks_given: bool) -> LseKernel:
    """Argument checks shared by ring and hybrid attention (no communication; the arguments are the
    same on every rank); returns the kernel. Whether it supports ``spec`` is checked after the
    cross-rank validation, where ``spec`` is known to agree."""
    if dropout:
        raise Refused(f"ring attention has no dropout (got dropout={dropout}): set the attention dropout"
                      " to 0 or use strategy='ulysses' with kernel='sdpa'")
    if comm not in COMMS:
        raise ValueError(f"unknown ring comm {comm!r}: choose one of {sorted(COMMS)}")
    if shard is not None and masks_given:
        raise ValueError("pass the padding mask and segment ids either in the SeqShard or as arguments, not both")
    return lse_kernel("auto" if kernel is None else kernel, q, spec)


def resolve_shard(shard: SeqShard | None, seq_lens: tuple[int, ...], layout: str | None, p: int,
                  ulysses: int = 1) -> SeqShard:
    """The SeqShard to use: the given one (checked against ``layout``) or one built from ``layout``.

    Pure (every rank computes the same from the same gathered lengths), so its ValueErrors are
    raised on every rank alike.
    """
    total = sum(seq_lens)
    if layout is None:
        return shard if shard is not None else SeqShard(seq_lens)
    expected = layout_seq_lens(total, p * ulysses, layout, ulysses)
    if shard is None and layout != "contiguous" and seq_lens != expected:
        raise ValueError(f"layout={layout!r} puts {list(expected)} tokens on the ranks but they hold {list(seq_lens)}:"
                         " shard the batch with the same layout (seqpar.shard_batch(..., layout=...))")
    perm = layout_permutation(total, p * ulysses, layout, ulysses)
    if shard is None:
        return SeqShard(seq_lens, None if layout == "contiguous" else perm)
    have = shard.positions.cpu() if shard.positions is not None else torch.arange(total)
    if have.shape != perm.shape or not torch.equal(have, perm):
        raise ValueError(f"layout={layout!r} does not match the SeqShard's token positions: omit layout to use"
                         " the shard's, or shard the batch with that layout")
    return shard
