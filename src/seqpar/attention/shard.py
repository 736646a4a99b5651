"""Batch-level facts about how the sequence is sharded, computed once per batch, used by every layer.

A :class:`SeqShard` says how long each rank's shard is, which global token sits at each position
of the layout (identity for a contiguous split, a permutation for zigzag), and which keys are
padding or belong to which packed document -- all in the *global* sequence. Attention layers read
it and issue no collective of their own for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.agree import check, share
from ..comm.collectives import comm_device, split_offsets
from ..comm.gather import gather_padded
from .layout import inverse_permutation


@dataclass(frozen=True)
class SeqShard:
    """How the sequence is laid out over the ranks of one sequence-parallel group.

    seq_lens   local length on each rank; the global sequence (in layout order) is rank 0's
               shard, then rank 1's, ...
    positions  [S] long: the index in the original sequence of each layout position (None:
               identity, i.e. a contiguous split). Causal masks and windows compare these.
    key_keep   [B, S] bool in layout order, False marks padding (None: no padding).
    segments   [B, S] long in layout order, packed-document id of each token (None: one document).

    A SeqShard describes one batch and is read, never written: plans made from its tensors are
    kept for the batch's later layers (:func:`shard_cache`, :func:`seqpar.attention.varlen.per_batch`),
    so its tensors must not be changed in place -- build a new one per batch (shard_batch does).
    """

    seq_lens: tuple[int, ...]
    positions: Tensor | None = None
    key_keep: Tensor | None = None
    segments: Tensor | None = None

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


_CACHES: dict[int, dict[Any, Any]] = {}


def shard_cache(shard: SeqShard) -> dict[Any, Any]:
    """A dict that lives as long as ``shard`` (one batch): what the layers of a batch would
    otherwise recompute per call -- ring block plans, block masks -- is kept here once."""
    cache = _CACHES.get(id(shard))
    if cache is None:
        cache = _CACHES[id(shard)] = {}
        weakref.finalize(shard, _CACHES.pop, id(shard), None)
    return cache


def batch_token(shard: SeqShard) -> object:
    """An object standing for the batch ``shard`` describes, alive as long as it; shards derived
    from it (:func:`chunked_documents`) share it."""
    return shard_cache(shard).setdefault("batch token", object())


def deferred_check(shard: SeqShard | None, *xs: Tensor | None) -> object | None:
    """The batch to check a call's failures once per (:class:`seqpar.comm.guard.Guard`'s ``batch``):
    the caller passed the batch's ``shard`` and autograd will differentiate the call, so the batch's
    loss or its backward's end is a check point every rank reaches. None otherwise: the call
    checks itself (a call that builds its own shard, a forward without autograd)."""
    if shard is None or not torch.is_grad_enabled() or not any(x is not None and x.requires_grad for x in xs):
        return None
    return batch_token(shard)


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
    return SeqShard(shard.seq_lens, shard.positions, keep, seg)


def chunked_documents(shard: SeqShard, chunk: int) -> SeqShard:
    """``shard`` with each packed document cut into chunks of ``chunk`` tokens counted from the
    document's start -- chunked attention (Llama 4's ``attention_chunk_size``) on packed rows as
    each document alone would see it -- as finer segment ids, so the layer runs without ``chunk``.
    Documents are the runs of equal segment id in the original token order (as shard_batch makes
    them). Kept per batch and chunk size (:func:`shard_cache`)."""
    assert shard.segments is not None, "only packed rows need their chunks counted per document"
    key = ("chunked documents", chunk)
    cache = shard_cache(shard)
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
        cache[key] = SeqShard(shard.seq_lens, shard.positions, shard.key_keep, finer)
        shard_cache(cache[key])["batch token"] = batch_token(shard)
    return cache[key]

