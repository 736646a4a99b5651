"""The run modes: how a handled token mixer runs under sequence parallelism and stays exact. Each
mixer is causal and runs along the whole sequence (a convolution over time, a recurrence or a
chunked scan), so on a shard alone it would start from a zero state at every rank but the first.
Each mode feeds the model's own module (the class's own code and kernels doing the work) what it
would see unsharded; the wrapper (:mod:`.wrap`) runs the mode :mod:`.choice` picks among the
family's list. The fourth mode, ``"state"`` (state passing: each rank its own tokens, the scan's
state across ranks), is its own module, :mod:`.state_passing`.

``"halo"`` (scalable) -- for a mixer that is per-token except for a causal convolution of width
``k`` (LFM2's short convolution; the family gives ``halo_width(module) = k - 1``): rank r receives
the last ``k - 1`` inputs of rank r - 1 (:func:`seqpar.comm.halo.halo_exchange`; their gradient
goes back in backward), runs the module on ``[halo, shard]`` and drops the halo's outputs. One
point-to-point exchange each way per layer, ``k - 1`` tokens; the mixer's compute is not repeated.
Fits a contiguous layout with shards of at least ``k - 1`` tokens.

``"heads"`` (scalable compute) -- for a mixer whose heads (or channels) are independent up to its
output projection; the family gives ``units(module)`` (how many to split), ``split_fits(module, p)``
and ``part(module, lo, hi, group)``: a copy of the module computing units ``lo .. hi`` whose weights
are views of the real parameters (:mod:`.views`). Every rank all-gathers the layer's input, runs
its part on the whole sequence, and the partial outputs are summed over the ranks while each keeps
its shard (:func:`seqpar.comm.gather.reduce_scatter_seq`). The compute is split P ways (ranks past
the last unit idle, in every collective still). Per layer an all-gather and a reduce-scatter each
way::

    hidden_states      # [B, S/P, D]   this rank's shard
    gather_seq         # [B, S, D]     backward: reduce-scatter of the ranks' input gradients
    module on heads    # [B, S, D]     this rank's heads' share of out_proj (a partial sum)
    reduce_scatter_seq # [B, S/P, D]   the sum over ranks, this rank's shard; backward: all-gather

``"gather"`` (exact, not scalable; always fits) -- every rank all-gathers the layer's input
sequence, runs the module on the whole sequence, keeps its own slice; backward reduce-scatters the
input gradient. The mixer's compute is repeated on all P ranks and its input is held whole for
that layer (attention stays sharded)::

    hidden_states  # [B, S/P, D]  this rank's shard, layout order
    gather_seq     # [B, S, D]    layout order; backward: reduce-scatter (each rank used it all)
    original order (inverse layout permutation: zigzag and doc-zigzag work too)
    module.forward # [B, S, D']   the model's own code: whole rows with the padding mask, or each
                   #              packed document alone (its state starts at the document)
    layout order, this rank's slice   # [B, S/P, D']

Packed rows: each document runs alone, as the models' own varlen paths (``cu_seq_lens`` /
``seq_idx``) and seqpar's reference define packing. Padding: whole rows get the padding mask the
model's own mixer takes (halo: the padding mask of the window).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...attention.layout import inverse_permutation
from ...attention.shard import SeqShard, shard_cache
from ...batch.local_batch import LocalBatch
from ...comm.collectives import split_offsets, split_sizes
from ...comm.gather import gather_seq, reduce_scatter_seq
from ...comm.halo import halo_exchange
from ...errors import Refused
from .registry import GATHER, HALO, HEADS, MixerFamily, register_mode

Forward = Callable[..., Tensor]
"""``forward(x [B, W, D], attention_mask=None) -> [B, W, D']``: a module's own forward."""


class HeadSplit(Protocol):
    """What a family that lists ``"heads"`` gives (see the module doc)."""

    def units(self, module: nn.Module) -> int: ...

    def split_fits(self, module: nn.Module, p: int) -> bool: ...

    def part(self, module: nn.Module, lo: int, hi: int, group: dist.ProcessGroup) -> nn.Module: ...


class HaloConv(Protocol):
    """What a family that lists ``"halo"`` gives: ``k - 1`` for the module's causal convolution of
    width ``k``, or -1 when it has none this mode can serve."""

    def halo_width(self, module: nn.Module) -> int: ...


def own_forward(module: nn.Module) -> Forward:
    """The class's ``forward`` on ``module`` (not seqpar's wrapper), without a cache."""
    original = type(module).forward

    def forward(x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return original(module, x, None, attention_mask)

    return forward


class Gather:
    """``"gather"``: the whole sequence on every rank (see the module doc); always fits."""

    name, description = GATHER, ("gathered: every rank runs the layer on the whole sequence (exact; its compute is "
                                 "repeated P times and its input is held whole)")

    def fits(self, family: MixerFamily, module: nn.Module, batch: LocalBatch) -> bool:
        return True

    def run(self, family: MixerFamily, module: nn.Module, x: Tensor, batch: LocalBatch,
            group: dist.ProcessGroup) -> Tensor:
        """``x [B, S/P, D]`` -> ``[B, S/P, D']`` (see the module doc)."""
        shard = batch.shard
        whole = gather_seq(x, dim=1, group=group, sizes=shard.seq_lens)  # [B, S, D] layout order
        out = in_order(own_forward(module), whole, shard)  # [B, S, D'] layout order
        start, n = shard.local_range(batch.sp_rank)
        return out.narrow(1, start, n)


class Heads:
    """``"heads"``: every rank its share of the heads over the whole sequence (see the module doc)."""

    name, description = HEADS, ("split by heads: every rank runs the whole sequence for its share of the key heads "
                                "and the partial outputs are summed (exact; compute split P ways, input held whole)")

    def fits(self, family: HeadSplit, module: nn.Module, batch: LocalBatch) -> bool:
        return family.split_fits(module, batch.sp_size)

    def run(self, family: HeadSplit, module: nn.Module, x: Tensor, batch: LocalBatch,
            group: dist.ProcessGroup) -> Tensor:
        """``x [B, S/P, D]`` -> ``[B, S/P, D]`` (see the module doc)."""
        shard = batch.shard
        whole = gather_seq(x, dim=1, group=group, sizes=shard.seq_lens)  # [B, S, D] layout order
        sizes = split_sizes(family.units(module), batch.sp_size)
        lo = split_offsets(sizes)[batch.sp_rank]
        if sizes[batch.sp_rank] == 0:  # more ranks than units: nothing to compute, the collectives still run
            partial = whole * 0
        else:
            part = family.part(module, lo, lo + sizes[batch.sp_rank], group)
            partial = in_order(own_forward(part), whole, shard)  # [B, S, D] this rank's heads' share
        return reduce_scatter_seq(partial, dim=1, group=group, sizes=shard.seq_lens)


class Halo:
    """``"halo"``: the shard plus the previous rank's last ``k - 1`` inputs (see the module doc)."""

    name, description = HALO, ("halo: each rank runs its shard plus the previous rank's last kernel-1 inputs (exact, "
                               "scalable; gathered under a permuted layout)")

    def fits(self, family: HaloConv, module: nn.Module, batch: LocalBatch) -> bool:
        """A contiguous layout, and every shard (but the last) at least the halo long."""
        width = family.halo_width(module)
        return (width >= 0 and batch.shard.positions is None
                and min(batch.shard.seq_lens[:-1], default=width) >= width)

    def run(self, family: HaloConv, module: nn.Module, x: Tensor, batch: LocalBatch,
            group: dist.ProcessGroup) -> Tensor:
        """``x [B, S/P, D]`` -> ``[B, S/P, D']`` (see the module doc)."""
        shard = batch.shard
        start, n = shard.local_range(batch.sp_rank)
        halo = halo_exchange(x, family.halo_width(module), dim=1, group=group)  # [B, h, D], h = 0 on rank 0
        h = halo.shape[1]
        window = torch.cat([halo, x], dim=1)  # [B, h + S/P, D] = tokens start - h .. start + n
        cols = slice(start - h, start + n)
        keep = None if shard.key_keep is None else shard.key_keep[:, cols].to(x.device)
        runs = _runs(shard)
        if runs is not None:  # the documents' pieces inside the window, in window coordinates
            runs = [[(max(a, start - h) - (start - h), min(e, start + n) - (start - h)) for a, e in row
                     if a < start + n and e > start - h] for row in runs]
        out = _run_rows(own_forward(module), window, keep, runs)  # [B, h + S/P, D']
        return out[:, h:]


for _mode in (Gather(), Heads(), Halo()):
    register_mode(_mode)


def in_order(forward: Forward, whole: Tensor, shard: SeqShard) -> Tensor:
    """``forward`` on the whole sequence ``whole [B, S, D]`` (layout order) run in original order
    -- whole rows with the padding mask, or each packed document alone -- back in layout order."""
    perm, keep = shard.positions, shard.key_keep
    if perm is not None:
        inv = inverse_permutation(perm).to(whole.device)
        whole = whole.index_select(1, inv)  # original order
        keep = None if keep is None else keep.index_select(1, inv.to(keep.device))
    out = _run_rows(forward, whole, None if keep is None else keep.to(whole.device), _runs(shard))  # [B, S, D']
    return out if perm is None else out.index_select(1, perm.to(whole.device))


def _runs(shard: SeqShard) -> list[list[tuple[int, int]]] | None:
    """Per row, the ``(start, end)`` of each packed document's real tokens in original order, or
    None when no row is packed (whole rows run with the padding mask). Kept per batch."""
    if shard.segments is None:
        return None
    cache = shard_cache(shard)
    if "mixer runs" not in cache:
        seg, keep = shard.segments, shard.key_keep
        if shard.positions is not None:
            inv = inverse_permutation(shard.positions)
            seg = seg.index_select(1, inv)
            keep = None if keep is None else keep.index_select(1, inv)
        seg = seg.cpu().tolist()
        keep = None if keep is None else keep.cpu().tolist()
        rows = []
        for b, ids in enumerate(seg):
            runs: list[tuple[int, int]] = []
            for i, d in enumerate(ids):
                real = keep is None or keep[b][i]
                if real and runs and runs[-1][1] == i and ids[runs[-1][0]] == d:
                    runs[-1] = (runs[-1][0], i + 1)
                elif real:
                    runs.append((i, i + 1))
            rows.append(runs)
        cache["mixer runs"] = rows
    return cache["mixer runs"]


def _run_rows(forward: Forward, x: Tensor, keep: Tensor | None, runs: list[list[tuple[int, int]]] | None) -> Tensor:
    """The module's own forward on ``x [B, W, D]`` (original order): whole rows with the padding
    mask ``keep [B, W]``, or, for packed rows, each document alone (zeros at padding)."""
    if runs is None:
        return mixer_output(forward(x, attention_mask=None if keep is None else keep.to(torch.long)))
    rows = []
    for b, row_runs in enumerate(runs):
        pieces, pos = [], 0
        for a, e in row_runs:
            out = mixer_output(forward(x[b:b + 1, a:e]))  # [1, e - a, D']
            if a > pos:
                pieces.append(out.new_zeros((1, a - pos, out.shape[-1])))
            pieces.append(out)
            pos = e
        rows.append(pieces)
    width = next((p.shape[-1] for pieces in rows for p in pieces), None)
    if width is None:  # nothing but padding: the outputs are never read, their shape still matters
        return mixer_output(forward(x)) * 0
    full = []
    for pieces in rows:
        n = sum(p.shape[1] for p in pieces)
        if n < x.shape[1]:
            pieces.append(x.new_zeros((1, x.shape[1] - n, width)))
        full.append(torch.cat(pieces, dim=1))
    return torch.cat(full, dim=0)  # [B, W, D']


def mixer_output(out: object) -> Tensor:
    """A token mixer's output, checked to be one tensor."""
    if not isinstance(out, Tensor):
        raise Refused(f"seqpar expected a token mixer to return one tensor, got {type(out).__name__}")
    return out
