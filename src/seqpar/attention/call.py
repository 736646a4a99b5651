"""One attention call, prepared: every strategy's entry is :func:`prepare` and then
:func:`seqpar.attention.run.run` (its body, under its guard, ending with its fence).

A call is described by its process groups (:class:`Groups`: heads split over a ``ulysses`` group,
K/V travelling around a ``ring``; Ulysses has the first, ring the second, hybrid both) and the
keyword options every strategy takes (:class:`AttnOptions`, :class:`RingOptions`). :func:`prepare`
turns them into an :class:`AttnCall`, in this order, before any collective that could hang::

    options     -> AttnSpec                  (causal, scale, window, softcap, chunk, sinks, dropout)
    local checks                             dropout / comm for a ring, masks given twice, the kernel
                                             (an lse kernel for a ring), grad group, shard size
    validation  -> every rank's length       one all-gather (two on a ring x ulysses grid), or the
                                             caller vouches (validate=False)
    kernel support                           after validation: the spec is the same everywhere now
    guard mode  -> the batch's record        checked once per batch, or per call
    layout      -> SeqShard                  the given one (checked against layout) or one built
    masks       -> global key mask, segments one all-gather per group (none with a batch's SeqShard)

so a new option or mask feature is read in one place, and a new strategy is a new :class:`Groups`
shape plus its local computation in :mod:`seqpar.attention.run`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..comm.guard import FailureRecord, Guard
from ..errors import Refused
from .blocks import RingStats
from .kernels import KernelArg, get_kernel, lse_kernel
from .layout import layout_permutation, layout_seq_lens
from .ring_comm import COMMS
from .shard import SeqShard, deferred_check, gather_global_masks
from .spec import AttnSpec, Kernel, MaskInfo, check_supported
from .validate import check_attention_inputs, check_grid_inputs, plan_code


class AttnOptions(TypedDict, total=False):
    """The keyword options of every attention function (``**options``), all optional.

    causal, scale, window, softcap, chunk, dropout: see :class:`~seqpar.attention.spec.AttnSpec`.
    sinks: ``[H]`` attention-sink logits (GPT-OSS), the same on every rank; may require grad: each
        rank's gradient covers its own heads (queries under a ring), so their sum is the total.
    kernel: the local kernel: ``"auto"`` (the default; see :mod:`seqpar.attention.kernels`), any
        other name there, a Kernel object or a callable ``fn(q, k, v, *, spec, mask) -> out`` in the
        ``[B, H, S, D]`` layout. A ring needs one that returns the log-sum-exp.
    key_padding_mask, segment_ids: this rank's ``[B, S_local]`` padding mask (True = real token)
        and packed-document ids, gathered with one small collective; or pass ``shard`` instead.
    shard: the batch's :class:`~seqpar.attention.shard.SeqShard` (lengths, positions, global masks;
        from :func:`seqpar.shard_batch`): reused at no cost, and a failure is checked once per batch.
    layout: ``"contiguous"``, ``"zigzag"`` or ``"doc-zigzag"`` (needs the batch's ``shard``): which
        tokens each rank holds (:func:`seqpar.attention.layout.layout_indices`); with ``shard`` it must agree
        with it. None: the shard's, else contiguous.
    validate: check shapes, dtypes and options across ranks first (one small all-gather). With
        False the caller vouches for them and ``shard`` gives the lengths (without it every rank is
        assumed to hold ``S_local`` tokens).
    """

    causal: bool
    scale: float | None
    window: int | None
    softcap: float | None
    chunk: int | None
    sinks: Tensor | None
    dropout: float
    kernel: KernelArg | None
    key_padding_mask: Tensor | None
    segment_ids: Tensor | None
    shard: SeqShard | None
    layout: str | None
    validate: bool


class RingOptions(AttnOptions, total=False):
    """:class:`AttnOptions` plus what a ring takes. ``comm``: how K/V travel, ``"p2p"`` (the
    default: one hop per step, overlapped) or ``"allgather"`` (gathered once). ``stats``: a
    :class:`~seqpar.attention.blocks.RingStats` this rank's forward work is added to."""

    comm: str
    stats: RingStats | None


ATTN_OPTIONS = frozenset(AttnOptions.__annotations__)
RING_OPTIONS = frozenset(RingOptions.__annotations__) | ATTN_OPTIONS


@dataclass(frozen=True)
class Groups:
    """The process groups of one call. Heads are split over ``ulysses`` (two all-to-alls), K/V
    travel around ``ring``; with both the ranks form a ``ring x ulysses`` grid, ring-major
    (``sp_rank = ring_rank * U + ulysses_rank``). ``ring_grad``: a second group over the ring's
    ranks for the backward's dK/dV hops. ``mesh`` and ``axes`` (the mesh axis of each group):
    where the groups come from when a mesh gave them (:func:`seqpar.sp_attention`) -- what a call
    inside ``torch.compile`` needs to find them again (:mod:`seqpar.attention.ops`). ``sp``: the
    whole grid's group when the mesh has one (hybrid only): the call's validation agrees over it,
    the group a rank that chose Ulysses or ring on the same mesh checks over, so a strategy
    disagreement is one ValueError on every rank, not collectives paired over different groups."""

    ulysses: dist.ProcessGroup | None = None
    ring: dist.ProcessGroup | None = None
    ring_grad: dist.ProcessGroup | None = None
    mesh: DeviceMesh | None = None
    axes: tuple[str | None, str | None] = (None, None)
    sp: dist.ProcessGroup | None = None

    @property
    def strategy(self) -> str:
        if self.ulysses is not None and self.ring is not None:
            return "hybrid"
        return "ulysses" if self.ulysses is not None else "ring"

    @property
    def sizes(self) -> tuple[int, int]:
        """``(U, R)``: the ulysses and ring degrees (1 without the group)."""
        return tuple(1 if g is None else dist.get_world_size(g) for g in (self.ulysses, self.ring))

    @property
    def ranks(self) -> tuple[int, int]:
        """This rank's ``(ulysses index, ring index)`` (0 without the group)."""
        return tuple(0 if g is None else dist.get_rank(g) for g in (self.ulysses, self.ring))

    @property
    def stages(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups in the order a fence visits them: the ulysses group, then the ring."""
        return tuple(g for g in (self.ulysses, self.ring) if g is not None)


@dataclass(frozen=True)
class AttnCall:
    """One prepared attention call: what to compute (``spec``, ``kernel``), over which ranks
    (``groups``) and tokens (``shard``: every sp rank's, in layout order, with the global masks),
    how K/V travel on a ring (``comm``, ``stats``), and how its failures are checked (``batch``:
    the batch's record, once per batch; None: by the call's own fences)."""

    groups: Groups
    spec: AttnSpec
    kernel: Kernel
    shard: SeqShard
    comm: str = "p2p"
    stats: RingStats | None = None
    batch: FailureRecord | None = None

    @property
    def what(self) -> str:
        return f"{self.groups.strategy} attention"

    def guard(self) -> Guard:
        """The call's guard: its local compute runs under it, its fences end the call."""
        return Guard(self.groups.stages, self.what, batch=self.batch)

    def ulysses_lens(self) -> list[int]:
        """The lengths of this ring rank's pieces over its ulysses group (every sp rank's, for
        Ulysses alone): what the all-to-alls gather."""
        (n_u, _), (_, r) = self.groups.sizes, self.groups.ranks
        return list(self.shard.seq_lens[r * n_u:(r + 1) * n_u])

    def ring_lens(self) -> tuple[int, ...]:
        """Each ring rank's length: its ulysses group's pieces together."""
        n_u, n_r = self.groups.sizes
        lens = self.shard.seq_lens
        return tuple(sum(lens[i * n_u:(i + 1) * n_u]) for i in range(n_r))

    def ring_shard(self) -> SeqShard:
        """The shard as the ring sees it (:meth:`ring_lens`), the batch's."""
        return self.shard.regrouped(self.ring_lens())

    def mask(self) -> MaskInfo:
        """The whole sequence's mask (Ulysses' local attention), the batch's."""
        return self.shard.mask()


def prepare(q: Tensor, k: Tensor, v: Tensor, groups: Groups, options: Mapping[str, Any], *, caller: str
            ) -> AttnCall:
    """The :class:`AttnCall` of ``caller`` (the public function, named in errors) from its inputs
    ``q [B, S_local, H, D]``, ``k [B, S_local, H_kv, D]``, ``v [B, S_local, H_kv, Dv]`` and its
    keyword options (see the module doc for what is done, in which order). Raises TypeError for an
    unknown option and ValueError -- on every rank alike -- for bad input."""
    ring = groups.ring is not None
    unknown = sorted(set(options) - (RING_OPTIONS if ring else ATTN_OPTIONS))
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    o = options
    dropout = o.get("dropout", 0.0)
    spec = AttnSpec(causal=o.get("causal", False), scale=o.get("scale"), window=o.get("window"),
                    softcap=o.get("softcap"), dropout=dropout, chunk=o.get("chunk"), sinks=o.get("sinks"))
    shard, mask, seg = o.get("shard"), o.get("key_padding_mask"), o.get("segment_ids")
    kernel = "auto" if o.get("kernel") is None else o["kernel"]
    comm = o.get("comm", "p2p")
    if ring:
        if dropout:
            raise Refused(f"ring attention has no dropout (got dropout={dropout}): set the attention dropout"
                          " to 0 or use strategy='ulysses' with kernel='sdpa'")
        if comm not in COMMS:
            raise ValueError(f"unknown ring comm {comm!r}: choose one of {sorted(COMMS)}")
    if shard is not None and (mask is not None or seg is not None):
        raise ValueError("pass the padding mask and segment ids either in the SeqShard or as arguments, not both")
    kern = lse_kernel(kernel, q, spec) if ring else get_kernel(kernel)
    if ring:
        check_grad_group(groups.ring, groups.ring_grad)
    (n_u, n_r), (u, r) = groups.sizes, groups.ranks
    if shard is not None and len(shard.seq_lens) != n_u * n_r:
        raise ValueError(f"the SeqShard has {len(shard.seq_lens)} shard lengths for "
                         + {"ring": f"a ring of {n_r} ranks: build it over this group",
                            "ulysses": f"a group of {n_u} ranks: build it over this group",
                            "hybrid": f"ulysses={n_u} x ring={n_r} = {n_u * n_r} ranks: build it over the sp axis"
                                      " of this mesh"}[groups.strategy])
    if o.get("validate", True):
        kw = dict(spec=spec, key_padding_mask=mask, segment_ids=seg,
                  shard_len=None if shard is None else shard.seq_lens[r * n_u + u],
                  how=plan_code(groups.strategy, o.get("layout"), comm if ring else None))
        if groups.strategy == "hybrid" and groups.sp is None:  # two bare groups: agree over each in turn
            seq_lens = check_grid_inputs(q, k, v, groups.ulysses, groups.ring, **kw)
        else:  # a hybrid's sp group lists its ranks ring-major, as the grid does
            seq_lens = check_attention_inputs(q, k, v, group=groups.sp or groups.stages[0], **kw)
    else:
        seq_lens = shard.seq_lens if shard is not None else (q.shape[1],) * (n_u * n_r)
    check_supported(kern, spec)  # after the cross-rank check: the spec is now known to be the same everywhere
    batch = deferred_check(shard, q, k, v, spec.sinks)
    # a layout is a permutation over ring ranks, each holding its ulysses group's pieces together
    ring_ranks, ulysses = (n_r, n_u) if groups.strategy == "hybrid" else (n_u * n_r, 1)
    sp_shard = resolve_shard(shard, tuple(seq_lens), o.get("layout"), ring_ranks, ulysses)
    if mask is not None or seg is not None:
        # the ring chunk inside the ulysses group, then the chunks over the ring (ring-major = layout order)
        lens = sp_shard.seq_lens
        stages = [(groups.ulysses, list(lens[r * n_u:(r + 1) * n_u]))] if groups.ulysses is not None else []
        if ring:
            stages.append((groups.ring, [sum(lens[i * n_u:(i + 1) * n_u]) for i in range(n_r)]))
        keep, segments = gather_global_masks(mask, seg, stages)
        sp_shard = SeqShard(lens, sp_shard.positions, keep, segments)
    return AttnCall(groups, spec, kern, sp_shard, comm, o.get("stats"), batch)


def check_grad_group(group: dist.ProcessGroup, grad_group: dist.ProcessGroup | None) -> None:
    """A ring's ``grad_group`` must hold ``group``'s ranks in the same order (dK/dV go back to the
    rank that owns the block). Local: the same answer on every rank, before any collective."""
    if grad_group is not None and dist.get_process_group_ranks(grad_group) != dist.get_process_group_ranks(group):
        raise ValueError(f"grad_group holds ranks {dist.get_process_group_ranks(grad_group)} but the ring's group "
                         f"{dist.get_process_group_ranks(group)}: pass a group over the same ranks in the same order "
                         "(seqpar.init_mesh makes one), or omit grad_group")


def resolve_shard(shard: SeqShard | None, seq_lens: tuple[int, ...], layout: str | None, p: int,
                  ulysses: int = 1) -> SeqShard:
    """The SeqShard to use: the given one (checked against ``layout``) or one built from ``layout``
    over ``p`` ring ranks of ``ulysses`` ranks each.

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
