"""One forward of a parallelized diffusers transformer: its sequences' shard lengths, the SeqShard
each attention layer runs on, and the two ops at the edges of the sharded region.

A :class:`ForwardCall` is made at the start of each forward (the model's pre-hook) and filled by the
plan's splits as they run: each split records its sequence's length, and once every sequence an
attention layer attends over is known, that layer's :class:`~seqpar.attention.shard.SeqShard` is
built -- outside the transformer blocks, so a compiled block only reads it::

    "" pre-hook      image N=7 -> (4, 3)    text T=5 -> (3, 2)
                     shards {image}: (4, 3)   {text, image}: (7, 5)
    blocks           attention reads shards[{text, image}]      # q [B, H, 7 or 5, D]
    exit             drop-in: all-gather (backward: this rank's slice, times P)
                     sharded: the local output, kept

Gradient rule (seqpar's, :mod:`seqpar.batch.loss`): every rank's parameter gradients are *averaged*
over the sp ranks afterwards (``seqpar.sync_gradients``, DDP, FSDP2). A split is a plain slice (its
backward puts this rank's gradient in its place, zeros elsewhere: the whole inputs upstream are the
same on every rank, and the average adds the ranks' slices up); the drop-in exit hands every rank
the whole output, each rank computes the same loss from it, so its backward keeps this rank's slice
times P (the average divides by P again). A checkpointed block recomputes its forward during the
backward, possibly after another forward ran: the exit's backward (the first step of a forward's
backward) makes that forward's call current again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ...attention.shard import BatchState, SeqShard, with_global_masks
from ...batch.loss import scale_grad
from ...comm.collectives import split_offsets, split_sizes
from ...comm.gather import gather_seq


class ForwardCall:
    """The state of one forward (see the module doc): ``sizes`` (sequence -> every rank's shard
    length), ``shards`` (the attended sequences, a frozenset -> SeqShard), the key-masked shards
    made from the masks the model passed (by mask tensor, kept for the forward's layers), and
    ``local_out`` (the sharded exit's output)."""

    def __init__(self, mesh: DeviceMesh, group: dist.ProcessGroup, compositions: tuple[frozenset[str], ...]) -> None:
        self.mesh, self.group = mesh, group
        self.p, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.compositions = compositions
        self.sizes: dict[str, tuple[int, ...]] = {}
        self.shards: dict[frozenset[str], SeqShard] = {}
        self.masked: list[tuple[Tensor, frozenset[str], SeqShard]] = []
        self.local_out: Tensor | None = None

    def record(self, seq: str, length: int, what: str) -> tuple[int, ...]:
        """Every rank's shard length of sequence ``seq`` (``length`` tokens in all), recorded; the
        shards of the compositions it completes are built. Raises ValueError (the same on every
        rank: the inputs agree) when another input of ``seq`` had another length."""
        sizes = tuple(split_sizes(length, self.p))
        have = self.sizes.get(seq)
        if have is not None and have != sizes:
            raise ValueError(f"seqpar: {what} has {length} {seq} tokens, but another input of the same "
                             f"sequence had {sum(have)}: pass inputs of one length per sequence")
        if have is None:
            self.sizes[seq] = sizes
            for comp in self.compositions:
                if comp not in self.shards and comp <= self.sizes.keys():
                    self.shards[comp] = SeqShard(self.seq_lens(comp), state=BatchState(self.mesh))
        return sizes

    def seq_lens(self, comp: frozenset[str]) -> tuple[int, ...]:
        """Every rank's length of the concatenation of the sequences ``comp``."""
        return tuple(sum(self.sizes[s][r] for s in comp) for r in range(self.p))

    def shard(self, comp: frozenset[str], mask: Tensor | None = None,
              keep_of: Callable[[Tensor], Tensor | None] | None = None) -> SeqShard:
        """The SeqShard of ``comp``; with the model's attention ``mask``, the shard with the global
        key mask ``keep_of(mask)`` stands for (this rank's ``[B, S_local]``, True = attend): read and
        gathered once per forward and mask object, whichever layers pass it."""
        base = self.shards[comp]
        if mask is None:
            return base
        for m, c, shard in self.masked:
            if m is mask and c == comp:
                return shard
        keep = keep_of(mask) if keep_of is not None else mask
        shard = base if keep is None else with_global_masks(base, keep, None, self.group)
        self.masked.append((mask, comp, shard))
        return shard


def split_local(x: Tensor, dim: int, sizes: tuple[int, ...], me: int, *, copy: bool = True) -> Tensor:
    """This rank's shard of ``x`` along ``dim`` (a slice: its gradient is zero outside it). ``copy``:
    a contiguous copy, so that a whole intermediate (a patch embedding's output) is not kept alive by
    the ops that save its shard; False for the model's own inputs, which the caller holds whole anyway."""
    shard = x.narrow(dim, split_offsets(sizes)[me], sizes[me])
    return shard.contiguous() if copy else shard


class _ExitMark(torch.autograd.Function):
    """Forward: the identity on the exit's local output. Backward: make this forward's
    :class:`ForwardCall` current on ``holder`` (checkpointed blocks recompute with it), then the
    identity. Not a collective."""

    @staticmethod
    def forward(ctx, x: Tensor, holder: Any, call: ForwardCall) -> Tensor:
        ctx.holder, ctx.call = holder, call
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.holder.current = ctx.call
        return grad, None, None


def leave(x: Tensor, dim: int, sizes: tuple[int, ...], call: ForwardCall, holder: Any, *, gather: bool) -> Tensor:
    """The exit: ``x [.., N_local, ..]`` marked for the backward (:class:`_ExitMark`), then
    all-gathered along ``dim`` (every rank's length in ``sizes``) with the backward "this rank's
    slice times P" (``gather``: the drop-in call) or returned as it is (sharded)."""
    x = _ExitMark.apply(x, holder, call) if torch.is_grad_enabled() else x
    if not gather:
        return x
    if call.p > 1:
        x = scale_grad(x, float(call.p))
    return gather_seq(x, dim=dim, group=call.group, sizes=sizes, grad="slice")
