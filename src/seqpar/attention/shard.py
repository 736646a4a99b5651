"""The batch plan: facts about how the sequence is sharded, computed once per batch, and the state
the layers of the batch share.

A :class:`SeqShard` says how long each rank's shard is, which global token sits at each position
of the layout (identity for a contiguous split, a permutation for zigzag), and which keys are
padding or belong to which packed document -- all in the *global* sequence. Attention layers read
it and issue no collective of their own for it. Its :class:`BatchState` owns what the batch's
layers share: the plans worked out once (ring block plans, document rectangles, block masks, a
model's dense masks), and the batch's failure record (:class:`seqpar.comm.guard.FailureRecord`);
they live exactly as long as the batch's SeqShard. Nothing of a batch is kept anywhere else.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..comm.agree import check, share
from ..comm.collectives import comm_device, split_offsets
from ..comm.gather import gather_padded
from ..comm.guard import FailureRecord
from .layout import inverse_permutation
from .spec import MaskInfo

_serials = itertools.count(1)
_LIVE: weakref.WeakValueDictionary[int, BatchState] = weakref.WeakValueDictionary()
"""Every live BatchState by its serial (never reused), for :func:`batch_state`; an entry goes with
its state."""


class BatchState:
    """What the layers of one batch share (see the module doc). ``cache``: plans by key, each
    computed by the first layer that needs it; ``failures``: the batch's once-per-batch failure
    record; ``mesh``: the mesh the batch was sharded over (:func:`seqpar.shard_batch`), where
    attention inside ``torch.compile`` finds its process groups (None for a shard built by hand);
    ``facts``: its SeqShard's lengths and tensors (what an op that gets only the handle needs)."""

    def __init__(self, mesh: DeviceMesh | None = None, failures: FailureRecord | None = None) -> None:
        self.cache: dict[Hashable, Any] = {}
        self.failures = failures if failures is not None else FailureRecord()
        self.mesh = mesh
        self.facts: tuple[tuple[int, ...], Tensor | None, Tensor | None, Tensor | None, Tensor | None] | None = None
        self.serial = next(_serials)
        _LIVE[self.serial] = self
        self._handle: Callable[[], Tensor | None] = lambda: None

    def __reduce__(self) -> tuple:
        # a SeqShard sent to another process (or deep-copied) describes the same batch, but plans,
        # failures and process groups are this process's: the copy starts with none
        return BatchState, ()

    def handle(self) -> Tensor:
        """A CPU int64 scalar naming this state, which it keeps alive: an opaque ``torch.library``
        op takes tensors and constants only, and reaches the state through it (:func:`batch_state`)
        -- a tensor, so a new batch is a new value, no recompilation -- and an autograd graph that
        saved it keeps the batch's plans until its backward. The state holds it weakly (no cycle)."""
        handle = self._handle()
        if handle is None:
            handle = torch.full((), self.serial, dtype=torch.int64)
            handle.seqpar_batch = self  # the handle owns the state, not the other way round
            self._handle = weakref.ref(handle)
        return handle

    def derived(self) -> BatchState:
        """The state of a shard derived from this batch's (its documents chunked, the ring's view
        in hybrid attention): plans of its own, the same batch (mesh, failure record)."""
        return BatchState(self.mesh, self.failures)

    def part(self, key: Hashable) -> dict[Hashable, Any]:
        """The plans of one part of the batch (a ring block, the whole sequence): a dict of its own
        inside ``cache`` (see :attr:`seqpar.attention.spec.MaskInfo.plans`)."""
        return self.cache.setdefault(("part", key), {})

    def shard(self) -> SeqShard:
        """The SeqShard this state belongs to (its facts, this state)."""
        assert self.facts is not None, "a BatchState outside a SeqShard"
        seq_lens, positions, keep, segments, blocks = self.facts
        return SeqShard(seq_lens, positions, keep, segments, state=self, blocks=blocks)


def batch_state(handle: Tensor) -> BatchState:
    """The live :class:`BatchState` a handle names (:meth:`BatchState.handle`). A host read of a
    CPU scalar."""
    state = _LIVE.get(int(handle))
    assert state is not None, "a batch's handle outlived its state"
    return state


@dataclass(frozen=True)
class SeqShard:
    """How the sequence is laid out over the ranks of one sequence-parallel group.

    seq_lens   local length on each rank; the global sequence (in layout order) is rank 0's
               shard, then rank 1's, ...
    positions  [S] long: the index in the original sequence of each layout position (None:
               identity, i.e. a contiguous split). Causal masks and windows compare these.
    key_keep   [B, S] bool in layout order, False marks padding (None: no padding).
    segments   [B, S] long in layout order, packed-document id of each token (None: one document).
    blocks     [B, S] long in layout order, bidirectional span id of each token, -1 for none (None:
               no spans): a query and a key of one span see each other whatever their order
               (:class:`~seqpar.attention.spec.MaskInfo`'s ``q_blk``); ids are the whole row's,
               so a span may straddle shards.
    state      what the batch's layers share (:class:`BatchState`): plans and the failure record;
               one per batch (a SeqShard given a state describes that state's batch).
    handle     the state's handle (:meth:`BatchState.handle`), kept as long as the shard.

    A SeqShard describes one batch and is read, never written: plans made from its tensors are
    kept for the batch's later layers (in ``state``), so its tensors must not be changed in
    place -- build a new one per batch (shard_batch does).
    """

    seq_lens: tuple[int, ...]
    positions: Tensor | None = None
    key_keep: Tensor | None = None
    segments: Tensor | None = None
    state: BatchState = field(default_factory=BatchState, compare=False, repr=False)
    blocks: Tensor | None = None
    handle: Tensor = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.state.facts is None:  # the state's first shard is the batch it describes
            self.state.facts = (self.seq_lens, self.positions, self.key_keep, self.segments, self.blocks)
        object.__setattr__(self, "handle", self.state.handle())

    def __reduce__(self) -> tuple:
        return _rebuild, (self.seq_lens, self.positions, self.key_keep, self.segments, self.blocks)

    @property
    def cache(self) -> dict[Hashable, Any]:
        """Plans kept for the batch's layers (``state.cache``)."""
        return self.state.cache

    def local_range(self, rank: int) -> tuple[int, int]:
        """``(start, length)`` of ``rank``'s shard in layout order."""
        return split_offsets(self.seq_lens)[rank], self.seq_lens[rank]

    def positions_of(self, rank: int, start: int = 0, n: int | None = None) -> Tensor:
        """``[n]`` long: the original index of tokens ``start .. start + n`` of ``rank``'s shard (the
        whole shard by default), on the device of ``positions`` (the CPU for a contiguous split)."""
        offset, length = self.local_range(rank)
        a = offset + start
        b = offset + (length if n is None else start + n)
        return self.positions[a:b] if self.positions is not None else torch.arange(a, b)

    def mask(self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
             device: torch.device | None = None) -> MaskInfo:
        """The :class:`MaskInfo` of queries ``rows`` against keys ``cols`` (``(start, n)`` in layout
        order; None: the whole sequence, positions left implicit where they are the identity), its
        tensors on ``device``, its plans kept in this batch's state. Built once per batch and
        block: the one place a batch's structure becomes a block's mask."""
        key = ("mask", rows, cols, device)
        if key not in self.cache:
            def positions(span: tuple[int, int] | None) -> Tensor | None:
                if span is None:
                    return self.positions
                a, n = span
                pos = self.positions[a:a + n] if self.positions is not None else torch.arange(a, a + n)
                return pos.to(device) if device is not None else pos

            def cut(t: Tensor | None, span: tuple[int, int] | None) -> Tensor | None:
                return t if t is None or span is None else t[:, span[0]:span[0] + span[1]]

            self.cache[key] = MaskInfo(q_pos=positions(rows), k_pos=positions(cols), key_keep=cut(self.key_keep, cols),
                                       q_seg=cut(self.segments, rows), k_seg=cut(self.segments, cols),
                                       plans=self.state.part(key), q_blk=cut(self.blocks, rows),
                                       k_blk=cut(self.blocks, cols))
        return self.cache[key]

    def regrouped(self, seq_lens: tuple[int, ...]) -> SeqShard:
        """The same sequence over fewer, longer shards (hybrid attention's ring: each ring rank
        holds its ulysses group's shards together); ``self`` when ``seq_lens`` are its own. Kept
        per batch."""
        if seq_lens == self.seq_lens:
            return self
        key = ("regrouped", seq_lens)
        if key not in self.cache:
            self.cache[key] = SeqShard(seq_lens, self.positions, self.key_keep, self.segments, self.state.derived(),
                                       self.blocks)
        return self.cache[key]


def _rebuild(seq_lens: tuple[int, ...], positions: Tensor | None, key_keep: Tensor | None, segments: Tensor | None,
             blocks: Tensor | None) -> SeqShard:
    """A pickled :class:`SeqShard` (the same batch, a fresh state: see ``BatchState.__reduce__``)."""
    return SeqShard(seq_lens, positions, key_keep, segments, blocks=blocks)


def shard_cache(shard: SeqShard) -> dict[Hashable, Any]:
    """A dict that lives as long as ``shard`` (one batch): what the layers of a batch would
    otherwise recompute per call is kept here once (``shard.state.cache``)."""
    return shard.state.cache


def deferred_check(shard: SeqShard | None, *xs: Tensor | None) -> FailureRecord | None:
    """The batch record to check a call's failures once per (:class:`seqpar.comm.guard.Guard`'s
    ``batch``): the caller passed the batch's ``shard`` and autograd will differentiate the call,
    so the batch's loss or its backward's end is a check point every rank reaches. None otherwise:
    the call checks itself (a call that builds its own shard, a forward without autograd)."""
    if shard is None or not torch.is_grad_enabled() or not any(x is not None and x.requires_grad for x in xs):
        return None
    return shard.state.failures


def gather_seq_shard(group: dist.ProcessGroup, *, local_len: int, batch_size: int,
                     key_padding_mask: Tensor | None = None, segment_ids: Tensor | None = None,
                     positions: Tensor | None = None, device: torch.device | None = None) -> SeqShard:
    """Build the :class:`SeqShard` of a batch from each rank's local pieces.

    ``key_padding_mask`` / ``segment_ids``: this rank's ``[B, S_local]`` (True / id per token);
    ``positions``: the whole ``[S]`` layout permutation (same on every rank) or None.
    Costs one metadata all-gather (lengths and flags, validated on every rank) plus, when a mask
    or segment ids are given, one all-gather of them together.
    """
    device = device or comm_device(group)
    facts = {"len": float(local_len), "batch": float(batch_size),
             "mask": 1.0 if key_padding_mask is not None else 0.0,
             "seg": 1.0 if segment_ids is not None else 0.0}
    problem = None
    for t, what in ((key_padding_mask, "key padding mask"), (segment_ids, "segment ids")):
        if t is not None and tuple(t.shape) != (batch_size, local_len):
            problem = f"{what} must be [batch, local_seq_len] = [{batch_size}, {local_len}]"
            break
    table = share(facts, group, problem=problem, device=device)
    names = {"batch": "batch size", "mask": "whether a key padding mask is given",
             "seg": "whether segment ids (packed sequences) are given"}
    check(table, same=list(names), describe=lambda n: names[n], what="sequence shard")
    seq_lens = tuple(int(n) for n in table.column("len"))
    return with_global_masks(SeqShard(seq_lens, positions), key_padding_mask, segment_ids, group, device)


def gather_global_masks(key_padding_mask: Tensor | None, segment_ids: Tensor | None,
                        stages: Sequence[tuple[dist.ProcessGroup, Sequence[int]]],
                        device: torch.device | None = None) -> tuple[Tensor | None, Tensor | None]:
    """The global ``[B, S]`` key mask and segment ids in layout order from each rank's
    ``[B, S_local]`` pieces: both travel in one all-gather per stage. ``stages``: ``(group, shard
    lengths along it)``, innermost first (hybrid: the ulysses group, then the ring)."""
    if key_padding_mask is None and segment_ids is None:
        return None, None
    pieces = [t.to(device=device or t.device, dtype=torch.int64) for t in (key_padding_mask, segment_ids)
              if t is not None]
    full = torch.stack(pieces)  # [n, B, S_local]
    for group, sizes in stages:
        full = gather_padded(full, 2, sizes, group)  # [n, B, S_stage]
    keep = full[0].bool() if key_padding_mask is not None else None
    seg = full[-1] if segment_ids is not None else None
    return keep, seg


def with_global_masks(shard: SeqShard, key_padding_mask: Tensor | None, segment_ids: Tensor | None,
                      group: dist.ProcessGroup, device: torch.device | None = None) -> SeqShard:
    """``shard`` plus the global key mask and segment ids, from each rank's ``[B, S_local]`` pieces
    (one all-gather of both together; none when neither is given)."""
    if key_padding_mask is None and segment_ids is None:
        return shard
    keep, seg = gather_global_masks(key_padding_mask, segment_ids, [(group, shard.seq_lens)], device)
    return SeqShard(shard.seq_lens, shard.positions, keep, seg, BatchState(shard.state.mesh, shard.state.failures),
                    shard.blocks)


def chunked_documents(shard: SeqShard, chunk: int) -> SeqShard:
    """``shard`` with each packed document cut into chunks of ``chunk`` tokens counted from the
    document's start -- chunked attention (Llama 4's ``attention_chunk_size``) on packed rows as
    each document alone would see it -- as finer segment ids, so the layer runs without ``chunk``.
    Documents are the runs of equal segment id in the original token order (as shard_batch makes
    them). Kept per batch and chunk size."""
    assert shard.segments is not None, "only packed rows need their chunks counted per document"
    key = ("chunked documents", chunk)
    cache = shard.cache
    if key not in cache:
        seg = shard.segments  # [B, S] layout order
        b, s = seg.shape
        perm = shard.positions
        orig = seg if perm is None else seg.index_select(1, inverse_permutation(perm))  # [B, S] original order
        idx = torch.arange(s, device=seg.device).expand(b, s)
        starts = torch.ones_like(orig, dtype=torch.bool)
        starts[:, 1:] = orig[:, 1:] != orig[:, :-1]
        start_of = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
        piece = (idx - start_of) // chunk  # [B, S] chunk index inside the document
        finer = orig * (s // chunk + 2) + piece
        finer = finer if perm is None else finer.index_select(1, perm)
        cache[key] = SeqShard(shard.seq_lens, shard.positions, shard.key_keep, finer, shard.state.derived(),
                              shard.blocks)
    return cache[key]

