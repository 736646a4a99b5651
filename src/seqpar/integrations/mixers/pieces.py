"""Where each rank's tokens sit in the original sequence, cut into *pieces* for the state-passing
run mode (:mod:`.state_passing`). Pure: computed from the batch's :class:`SeqShard`, the same on
every rank, no communication; kept per batch (:func:`seqpar.attention.shard.shard_cache`).

A piece is a run of one row's tokens that are consecutive in the original order, held by one rank
at consecutive places of its shard, and inside one document. A recurrence over the row is then a
chain of pieces: each piece's initial state is its predecessor's final state (``pred``), or zero
where it starts a document (``pred = -1``)::

    S = 12, P = 2, zigzag (chunks of 3 go to r0 r1 r1 r0), one row packed as documents [0, 5), [5, 12)

    original:  0 1 2 | 3 4 | 5 6 7 8 | 9 10 11
    rank:      r0      r1    r1        r0
    piece:     a0      b0    b1        a1        b0 ends document 1, b1 starts document 2
    chain:     a0 -> b0      b1 -> a1            a0 and b1 start from a zero state

Unpacked rows are one document each, padding included (the model runs padded rows whole, with
its padding mask); packed rows leave their padding out (each document runs alone, as
:func:`seqpar.testing.model_parity.reference_token_loss` defines packing).

Pieces are numbered rank by rank (rank 0's first), each rank's by row, then position (``flat``).
Only pieces that some piece continues cross ranks (``sent``: in the contiguous layout one per row
and rank, whatever the documents; a document's last piece passes nothing on), in that order
(``row``). ``levels`` groups them by their depth in the chain, so a prefix over the chains runs one
batched step per level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from ...attention.layout import inverse_permutation
from ...attention.shard import SeqShard, shard_cache
from ...comm.collectives import split_offsets


@dataclass(frozen=True)
class Piece:
    """One piece: ``length`` tokens of batch row ``row`` starting at ``start`` in its rank's shard
    (layout order) and at ``origin`` in the original sequence; ``pred`` is the flat index of the
    piece that ends at ``origin - 1`` in the same document, or -1."""

    row: int
    start: int
    length: int
    origin: int
    pred: int

    @property
    def end(self) -> int:
        """One past its last token, in the original sequence."""
        return self.origin + self.length


@dataclass(frozen=True)
class PiecePlan:
    """Every rank's pieces of one batch (see the module doc). ``cache``: what the layers of the
    batch would otherwise rebuild per call (index tensors), kept as long as the plan."""

    by_rank: tuple[tuple[Piece, ...], ...]
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def flat(self) -> tuple[Piece, ...]:
        return tuple(p for pieces in self.by_rank for p in pieces)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """The flat index of each rank's first piece."""
        return tuple(split_offsets([len(p) for p in self.by_rank]))

    @cached_property
    def sent(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the indices (in its own list) of its pieces that some piece continues -- all
        that crosses ranks: a document's last piece passes nothing on. Every predecessor is one of
        them, on another rank (a rank's consecutive tokens of one document form one piece)."""
        preds = {p.pred for p in self.flat if p.pred >= 0}
        return tuple(tuple(j for j in range(len(pieces)) if self.offsets[r] + j in preds)
                     for r, pieces in enumerate(self.by_rank))

    @cached_property
    def counts(self) -> tuple[int, ...]:
        """How many pieces each rank sends (:attr:`sent`): the all-gathers' sizes."""
        return tuple(len(s) for s in self.sent)

    @cached_property
    def row(self) -> dict[int, int]:
        """Flat index of a sent piece -> its row in the all-gathered rows (rank by rank)."""
        order = [self.offsets[r] + j for r, sent in enumerate(self.sent) for j in sent]
        return {i: k for k, i in enumerate(order)}

    @cached_property
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """Sent pieces (flat indices) by depth in their chain: level 0 starts a document, level d
        follows level d - 1 -- the prefix runs one batched step per level."""
        depth: dict[int, int] = {}
        # a predecessor lies earlier in its row's original order: visit pieces in that order
        for i in sorted(self.row, key=lambda i: (self.flat[i].row, self.flat[i].origin)):
            pred = self.flat[i].pred
            depth[i] = 0 if pred < 0 else depth[pred] + 1
        out: list[list[int]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
        for i in self.row:
            out[depth[i]].append(i)
        return tuple(tuple(level) for level in out)

    def halo_index(self, rank: int, width: int) -> list[list[int]]:
        """For each of ``rank``'s pieces, where its ``width`` preceding inputs (original order) are
        in the all-gathered tails: every sent piece's last ``width`` inputs (zeros in front of a
        piece shorter than that), ``[sent pieces, width]`` flattened, then one zero row at index
        ``len(row) * width`` for inputs before the document's start."""
        zero = len(self.row) * width
        out = []
        for piece in self.by_rank[rank]:
            row = []
            for q in range(piece.origin - width, piece.origin):
                cur = piece.pred
                while cur >= 0 and q < self.flat[cur].origin:  # walk back to the piece holding q
                    cur = self.flat[cur].pred
                # q lies in the last `width` tokens of that piece: it ends before `piece` starts
                row.append(zero if cur < 0 else self.row[cur] * width + width - (self.flat[cur].end - q))
            out.append(row)
        return out


def piece_plan(shard: SeqShard, batch_size: int) -> PiecePlan:
    """The pieces of ``shard`` (rows ``0 .. batch_size - 1``), kept per batch."""
    cache = shard_cache(shard)
    if "state pieces" not in cache:
        cache["state pieces"] = _plan(shard, batch_size)
    return cache["state pieces"]


def _plan(shard: SeqShard, batch_size: int) -> PiecePlan:
    s = sum(shard.seq_lens)
    offsets = torch.tensor(split_offsets(shard.seq_lens))
    where = torch.arange(s) if shard.positions is None else inverse_permutation(shard.positions.cpu())
    owner = torch.searchsorted(offsets, where, right=True) - 1  # [S] original order: the rank holding it
    local = where - offsets[owner]  # [S] its index in that rank's shard
    packed = shard.segments is not None
    seg = keep = None
    if packed:  # original order, [B, S]
        seg = shard.segments.cpu().index_select(1, where)
        keep = (torch.ones_like(seg, dtype=torch.bool) if shard.key_keep is None
                else shard.key_keep.cpu().index_select(1, where))
    new = torch.ones(batch_size, s, dtype=torch.bool)  # a piece starts here
    new[:, 1:] = ((owner[1:] != owner[:-1]) | (local[1:] != local[:-1] + 1)).expand(batch_size, -1)
    doc = torch.zeros(batch_size, s, dtype=torch.bool)  # a document starts here
    doc[:, 0] = True
    if packed:
        doc[:, 1:] = (seg[:, 1:] != seg[:, :-1]) | ~keep[:, :-1]
        new |= doc | torch.cat([torch.ones(batch_size, 1, dtype=torch.bool), keep[:, 1:] != keep[:, :-1]], 1)
    by_rank: list[list[tuple[int, int, int, int, int]]] = [[] for _ in shard.seq_lens]  # row, start, n, origin, pred
    owner_l, local_l = owner.tolist(), local.tolist()
    for b in range(batch_size):
        starts = new[b].nonzero().flatten().tolist()
        prev: tuple[int, int] | None = None  # (rank, index) of the row's previous piece
        for a, e in zip(starts, [*starts[1:], s], strict=True):
            if packed and not keep[b, a]:
                prev = None  # padding between documents
                continue
            r = owner_l[a]
            pred = (-1, -1) if bool(doc[b, a]) or prev is None else prev
            by_rank[r].append((b, local_l[a], e - a, a, *pred))
            prev = (r, len(by_rank[r]) - 1)
    flat_of = split_offsets([len(p) for p in by_rank])
    return PiecePlan(tuple(tuple(Piece(b, start, n, origin, -1 if pr < 0 else flat_of[pr] + pi)
                                 for b, start, n, origin, pr, pi in pieces) for pieces in by_rank))
