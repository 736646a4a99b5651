"""``"state"``: state passing, the run mode in which every rank processes only its own tokens.

A recurrent mixer -- a short causal convolution, then a scan linear in its initial state (Gated
DeltaNet, Kimi delta attention, Mamba2, Mamba: :mod:`.state_scans`), then per-token gates and
projections -- runs as the model's own ``forward`` on this rank's shard ``[B, S/P, D]``, with two
of the kernel functions it calls swapped for the call (:mod:`seqpar.compat`):

* the convolution gets a halo: each piece of the shard (:mod:`.pieces`: a run of tokens
  consecutive in the original order, inside one document) is prefixed with the ``k - 1``
  convolution inputs before it in the original order -- from whichever rank holds them, zeros at a
  document's start. Every rank's pieces' last ``k - 1`` inputs travel in one all-gather.
* the scan runs each piece from a zero state, once, and returns each piece's summary: its
  transition ``M`` and its final state ``B``. One all-gather of the summaries (``P x pieces`` small
  ``[K, K]`` / ``[K, V]``-sized matrices, independent of S), a prefix over the chains of pieces in
  the original order (``S_next = M . S + B``, float32 or float64; a document's first piece starts
  from zero) and each piece's output gets its initial state's share (``out0 + Q(S)``).

Everything around the two kernels (projections, gates, norms, the output projection) is per token
and runs on the shard as it is. Per layer, forward: two all-gathers, neither of them O(S); the
backward reduce-scatters their gradients. Compute and memory per rank are those of S/P tokens
(times the scan's extra work: :mod:`.state_scans`). Any layout (contiguous, zigzag, doc-zigzag):
pieces are read in the original order, no token moves::

    hidden_states          # [B, S/P, D]   this rank's shard, layout order
    forward (model's own)  #   conv(x)     -> conv(halo | piece) per piece   all-gather of tails
                           #   scan(...)   -> out0, (M, B) per piece          all-gather of (M, B)
                           #                  prefix in original order -> S per piece
                           #                  out0 + Q(S)
    out                    # [B, S/P, D]
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...batch.local_batch import LocalBatch
from ...comm.gather import gather_seq
from ...compat import KernelCall, kernel_route, kernelized_funcs, kernels_replaced, modeling_module
from .modes import mixer_output, own_forward
from .pieces import Piece, PiecePlan, piece_plan
from .registry import STATE, MixerFamily, StateKernels, register_mode
from .state_scans import StateScan


class StatePassing:
    """``"state"``: each rank runs its own tokens, the scan's state crosses ranks (see the module doc)."""

    name, description = STATE, ("state passing: each rank runs the layer on its own tokens, the convolution takes "
                                "a halo and the scan's state crosses ranks (exact; compute, memory and input per "
                                "rank O(S/P), communication independent of S)")

    def fits(self, family: MixerFamily, module: nn.Module, batch: LocalBatch) -> bool:
        """The family declares its kernels, the class's forward still reaches them (no helper on the
        way replaced by ``kernelize``), every shard has a token."""
        return min(batch.shard.seq_lens) >= 1 and state_unavailable(family, module) is None

    def run(self, family: MixerFamily, module: nn.Module, x: Tensor, batch: LocalBatch,
            group: dist.ProcessGroup) -> Tensor:
        """``x [B, S/P, D]`` -> ``[B, S/P, D']`` (see the module doc)."""
        kernels = family.state
        assert kernels is not None
        shard = batch.shard
        start, n = shard.local_range(batch.sp_rank)
        keep = None if shard.key_keep is None else shard.key_keep[:, start:start + n].to(x.device, torch.long)
        gather = partial(gather_seq, dim=0, group=group)
        call = StateCall(kernels, piece_plan(shard, x.shape[0]), batch.sp_rank, gather)
        replacements = {kernels.conv: call.conv, kernels.scan: call.scan, **dict.fromkeys(kernels.fused, _no_fused)}
        with kernels_replaced(modeling_module(type(module)), replacements) as originals:
            call.originals = originals
            return mixer_output(own_forward(module)(x, attention_mask=keep))


register_mode(StatePassing())


def state_unavailable(family: MixerFamily, module: nn.Module) -> str | None:
    """Why ``module`` cannot run state passing on the installed transformers (None: it can): the
    family declares no kernels, its class's forward no longer reaches them (a release renamed or
    moved them: :func:`seqpar.compat.kernel_route`), or ``kernelize`` replaced a helper the swap
    goes through on this instance (the helper would bypass the swapped kernels)."""
    kernels = family.state
    if kernels is None:
        return f"{family.name} declares no state kernels"
    route = _route(type(module), kernels.names)
    if route is None:
        return (f"{type(module).__name__}.forward does not reach the kernel functions state passing swaps "
                f"({', '.join(kernels.names)} in {type(module).__module__})")
    replaced = sorted(kernelized_funcs(module) & {via for via in route.values() if via is not None})
    if replaced:
        return (f"kernelize replaced {', '.join(replaced)} on this {type(module).__name__}, which the swapped "
                "kernels are reached through")
    return None


@cache
def _route(cls: type, names: tuple[str, ...]) -> dict[str, str | None] | None:
    return kernel_route(cls, names)


def _no_fused(*args: Any, **kwargs: Any) -> None:
    """A fused convolution + scan + norm kernel (Mamba2's ``mamba_split_conv1d_scan_combined``)
    answers None: the model's own contract for "no fused kernel here", after which its forward
    takes the separate kernels, which state passing serves."""
    return None


Gather = Callable[..., Tensor]
"""``gather(t [n, ...], sizes=counts) -> [sum(counts), ...]``: every rank's ``t`` in rank order, with
autograd (:func:`seqpar.comm.gather.gather_seq` over the SP group, dim 0)."""


class StateCall:
    """One mixer call's replacement kernels (:meth:`conv`, :meth:`scan`): this rank's pieces, the
    all-gather over the SP group (``gather``; the unit tests pass an in-process one), and the
    kernels they replace (``originals``, by name: set once :func:`seqpar.compat.kernels_replaced` has
    them)."""

    def __init__(self, kernels: StateKernels, plan: PiecePlan, rank: int, gather: Gather) -> None:
        self.kernels, self.plan, self.rank, self.gather = kernels, plan, rank, gather
        self.pieces = plan.by_rank[rank]
        self.sent = list(plan.sent[rank])  # the pieces another rank continues (their tails, their states)
        self.originals: dict[str, Callable[..., Any]] = {}
        buckets: dict[int, list[int]] = {}  # pieces of one length run as one batch of rows
        for i, piece in enumerate(self.pieces):
            buckets.setdefault(piece.length, []).append(i)
        self.buckets = list(buckets.values())

    def conv(self, *args: Any, **kwargs: Any) -> Tensor:
        """The causal convolution of ``hidden_states [B, C, S/P]`` over each piece with its halo."""
        call = KernelCall(self.originals[self.kernels.conv], args, kwargs)
        x, width = call["hidden_states"], call["weight"].shape[-1] - 1  # weight [C, k]
        halos, every = self._halos(x, width)  # [pieces, C, k - 1]
        outs = []
        for idx in self.buckets:
            piece_x = torch.cat([halos[idx], _take(x, [self.pieces[i] for i in idx], 2)], 2)  # [n, C, k - 1 + len]
            outs.append(call.replace(hidden_states=piece_x)()[..., width:])
        return _tied(_put(x.new_zeros(x.shape), self.pieces, self.buckets, outs, 2), every)

    def _halos(self, x: Tensor, width: int) -> tuple[Tensor, Tensor | None]:
        """``[pieces, C, width]``: each piece's ``width`` inputs before it (original order, same
        document; zeros before its start), from every rank's pieces' last ``width`` inputs; and
        the all-gathered tails (every rank gathers, pieces or not)."""
        c = x.shape[1]
        if width == 0:
            return x.new_zeros(len(self.pieces), c, 0), None
        sent = [self.pieces[i] for i in self.sent]
        tails = [_pad_left(x[p.row, :, max(p.start, p.start + p.length - width):p.start + p.length], width)
                 for p in sent]
        # no tail to send: still an input of x's graph, so that the gather's backward runs here too
        tails_t = torch.stack(tails) if tails else x[:0, :, :1].expand(0, c, width)  # [sent, C, width]
        every = self.gather(tails_t, sizes=self.plan.counts)  # [all sent, C, width]
        table = torch.cat([every.transpose(1, 2).reshape(-1, c), every.new_zeros(1, c)])  # [all * width + 1, C]
        key = ("halo index", self.rank, width, x.device)
        if key not in self.plan.cache:
            self.plan.cache[key] = torch.tensor(self.plan.halo_index(self.rank, width), device=x.device,
                                                dtype=torch.long).view(len(self.pieces), width)
        return table[self.plan.cache[key]].transpose(1, 2), every

    def scan(self, *args: Any, **kwargs: Any) -> Any:
        """The scan on each piece from its true initial state (see the module doc)."""
        kind: StateScan = self.kernels.kind
        call = KernelCall(self.originals[self.kernels.scan], args, kwargs)
        # with no piece on this rank (packed padding only), one token stands in for the shapes
        pieces, buckets = (self.pieces, self.buckets) if self.pieces else ((Piece(0, 0, 1, 0, -1),), [[0]])
        subs = [call.replace(**{name: _take(call[name], [pieces[i] for i in idx], dim)
                                for name, dim in kind.token_dims.items() if call[name] is not None})
                for idx in buckets]
        locals_ = [kind.local(sub) for sub in subs]  # each bucket from a zero state
        rows = torch.tensor([i for idx in buckets for i in idx]).argsort()  # piece -> its row, bucket order
        m, b = (torch.cat([getattr(loc, f) for loc in locals_])[rows.to(locals_[0].state.device)]
                for f in ("transition", "state"))  # [pieces, *M], [pieces, *B]
        dtype = torch.promote_types(b.dtype, torch.float32)
        sent = torch.tensor(self.sent, dtype=torch.long, device=b.device)
        mine = torch.cat([m.flatten(1), b.flatten(1)], 1).to(dtype)[sent]  # [sent, |M| + |B|]
        every = self.gather(mine, sizes=self.plan.counts)  # [all sent, |M| + |B|]
        split = m[0].numel()
        m_all, b_all = every[:, :split].reshape(-1, *m.shape[1:]), every[:, split:].reshape(-1, *b.shape[1:])
        initial = (_initial_states(self.plan, self.rank, m_all, b_all, self.kernels.kind.combine) if self.pieces
                   else b.new_zeros(1, *b.shape[1:], dtype=dtype))  # [pieces, *B]
        outs = [kind.correct(sub, loc, initial[idx]) for sub, loc, idx in zip(subs, locals_, buckets, strict=True)]
        template = call[next(iter(kind.token_dims))]
        full = outs[0].new_zeros(_out_shape(template, outs[0], kind.out_dim))
        if self.pieces:
            full = _put(full, self.pieces, self.buckets, outs, kind.out_dim)
        return kind.result(_tied(full, every), call)


def _tied(out: Tensor, gathered: Tensor | None) -> Tensor:
    """``out``, made to depend on ``gathered`` (with a zero gradient): every rank must run the
    all-gather's backward (a reduce-scatter), also a rank whose output does not read it -- the first
    rank's pieces start from zero, a rank without pieces reads nothing. An empty slice's sum is an
    exact zero whatever the values."""
    return out if gathered is None else out + gathered[:0].sum().to(out.dtype)


def _pad_left(t: Tensor, width: int) -> Tensor:
    """``t [..., n]`` with zeros in front up to ``[..., width]``."""
    return t if t.shape[-1] == width else torch.cat([t.new_zeros(*t.shape[:-1], width - t.shape[-1]), t], -1)


def _out_shape(template: Tensor, out: Tensor, dim: int) -> list[int]:
    """The full output's shape: rows and tokens of ``template`` (a token argument), the rest of ``out``."""
    shape = list(out.shape)
    shape[0], shape[dim] = template.shape[0], template.shape[dim]
    return shape


def _whole_rows(pieces: list[Piece], rows: int, length: int) -> bool:
    """The pieces are rows ``0 .. rows - 1`` whole, in order: the common case (contiguous, unpacked)."""
    return len(pieces) == rows and all(p.row == i and p.start == 0 and p.length == length
                                       for i, p in enumerate(pieces))


def _take(t: Tensor, pieces: list[Piece], dim: int) -> Tensor:
    """``[n, ..., len, ...]``: each piece's tokens of ``t [B, ..., S/P, ...]`` (tokens along ``dim``)."""
    if _whole_rows(pieces, t.shape[0], t.shape[dim]):
        return t
    return torch.stack([t[p.row].narrow(dim - 1, p.start, p.length) for p in pieces])


def _put(full: Tensor, pieces: tuple[Piece, ...], buckets: list[list[int]], outs: list[Tensor], dim: int) -> Tensor:
    """``full`` (zeros, ``[B, ..., S/P, ...]``) with each bucket's outputs at its pieces' tokens
    (tokens in no piece -- padding of packed rows -- stay zero)."""
    if len(buckets) == 1 and _whole_rows([pieces[i] for i in buckets[0]], full.shape[0], full.shape[dim]):
        return outs[0]
    full = full.movedim(dim, 1)  # [B, S/P, ...]
    for idx, out in zip(buckets, outs, strict=True):
        n = pieces[idx[0]].length
        rows = torch.tensor([pieces[i].row for i in idx], device=full.device).repeat_interleave(n)
        cols = (torch.tensor([pieces[i].start for i in idx], device=full.device)[:, None]
                + torch.arange(n, device=full.device)).flatten()
        full = full.index_put((rows, cols), out.movedim(dim, 1).reshape(len(idx) * n, *full.shape[2:]))
    return full.movedim(1, dim)


def _initial_states(plan: PiecePlan, rank: int, m_all: Tensor, b_all: Tensor,
                    combine: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Each of ``rank``'s pieces' initial state ``[pieces, *B]``: the prefix ``S_next = M . S + B``
    along every chain of sent pieces (``m_all``, ``b_all``: their summaries, rows as
    :attr:`PiecePlan.row`), one batched step per chain level (a piece's predecessor is one level
    up), zero for a document's first piece."""
    where: dict[int, tuple[int, int]] = {}  # flat piece -> (level, row in that level's states)
    finals: list[Tensor] = []
    for d, level in enumerate(plan.levels):
        idx = torch.tensor([plan.row[i] for i in level], device=b_all.device)
        if d == 0:  # from a zero state, the final state is B
            finals.append(b_all[idx])
        else:
            pred = torch.tensor([where[plan.flat[i].pred][1] for i in level], device=b_all.device)
            finals.append(combine(m_all[idx], finals[d - 1][pred]) + b_all[idx])
        where.update({i: (d, j) for j, i in enumerate(level)})
    out = []
    for piece in plan.by_rank[rank]:
        if piece.pred < 0:
            out.append(b_all.new_zeros(b_all.shape[1:]))
        else:
            d, j = where[piece.pred]
            out.append(finals[d][j])
    return torch.stack(out) if out else b_all.new_zeros(0, *b_all.shape[1:])
