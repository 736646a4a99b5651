"""Sequence layouts: which global tokens each sequence-parallel rank holds. Pure functions, no communication.

A layout is a permutation of token indices followed by a contiguous split (``tensor_split``). The
rank order is ring-major: ``sp_rank = ring_idx * ulysses + ulysses_idx``, so the ulysses ranks of
one ring step hold consecutive pieces of the permuted sequence.

``"contiguous"`` -- rank r holds ``tensor_split(range(S), sp)[r]``. Under causal attention the last
rank's queries see the whole sequence and the first rank's almost nothing (~2x the mean work).

``"zigzag"`` -- with ``R = sp // ulysses`` ring ranks, the sequence is cut into ``2R`` chunks
(``tensor_split``, uneven allowed) and ring rank ``i`` holds chunks ``i`` and ``2R-1-i``: an early
chunk with little causal work and a late one with much, so every ring rank does about the same.
Within a ring rank its two chunks (concatenated) are split contiguously over its ulysses ranks::

    S = 16, sp = 4, ulysses = 1 (R = 4, 8 chunks of 2 tokens)

    chunk:    c0    c1    c2    c3    c4    c5    c6    c7
    tokens:  0 1 | 2 3 | 4 5 | 6 7 | 8 9 |10 11|12 13|14 15
    rank:     r0    r1    r2    r3    r3    r2    r1    r0

    rank 0: [0 1 14 15]   rank 1: [2 3 12 13]   rank 2: [4 5 10 11]   rank 3: [6 7 8 9]

    S = 16, sp = 4, ulysses = 2 (R = 2, 4 chunks of 4 tokens)

    chunk:      c0        c1        c2        c3
    ring rank:  g0        g1        g1        g0
    g0 = [0 1 2 3 12 13 14 15] -> sp rank 0: [0 1 2 3]    sp rank 1: [12 13 14 15]
    g1 = [4 5 6 7  8  9 10 11] -> sp rank 2: [4 5 6 7]    sp rank 3: [8 9 10 11]

``"doc-zigzag"`` -- zigzag inside every packed document, for the whole batch with one permutation.
On packed rows a query sees only its own document, so whole-row zigzag is off balance (max/mean
work 1.3-1.5 at P = 2-4 with documents log-uniform in 64..S: ``benchmarks/bench_balance.py``).
The sequence is cut at :func:`document_cuts`: wherever, in any row of the batch, a document starts
or padding starts or ends. Inside one piece each row's causal work per query grows by a constant
step per token (one key, or none in padding), so the piece's work summed over the rows is linear
in the position, and zigzag on the piece -- ``2R`` parts, ring rank ``i`` takes parts ``i`` and ``2R-1-i``
-- gives every ring rank the same work. A ring rank holds its parts of all pieces in token order,
split contiguously over its ulysses ranks as in zigzag. Where a piece does not divide into ``2R``
equal parts, its extra tokens go to the ring ranks holding the fewest tokens so far (ties: the
lower rank; head and tail part in turn), so ring ranks' lengths differ by at most one token::

    S = 16, sp = 2 (R = 2), one row with documents [0, 4) and [4, 16): cuts (4,)

    piece:      p0 (4 tokens)       p1 (12 tokens, 4 parts of 3)
    tokens:     0 | 1 | 2 | 3       4 5 6 | 7 8 9 | 10 11 12 | 13 14 15
    rank:       r0  r1  r1  r0       r0       r1       r1         r0

    rank 0: [0 3 4 5 6 13 14 15]   rank 1: [1 2 7 8 9 10 11 12]
    causal work (keys seen): 44 and 44; whole-row zigzag gives 52 and 36

With no cuts (one document, no padding) it is zigzag up to which ranks take the extra tokens. The
cuts come from the batch, so ``"doc-zigzag"`` needs them (:func:`seqpar.shard_batch` computes them:
every SP rank holds the same full batch, so every rank derives the same permutation).

The concatenation of all ranks' indices is the layout permutation (``SeqShard.positions``); a
tensor in layout order goes back to the original order with the inverse permutation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag", "doc-zigzag")


def _check(seq_len: int, sp: int, layout: str, ulysses: int, cuts: Sequence[int] | None) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {list(LAYOUTS)}")
    if not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be a non-negative int, got {seq_len!r}")
    if not isinstance(sp, int) or sp < 1:
        raise ValueError(f"sp (the sequence-parallel degree) must be a positive int, got {sp!r}")
    if not isinstance(ulysses, int) or ulysses < 1 or sp % ulysses:
        raise ValueError(f"ulysses={ulysses!r} must be a positive divisor of sp={sp}: choose ulysses in "
                         f"{[d for d in range(1, sp + 1) if sp % d == 0]}")
    if layout != "doc-zigzag":
        if cuts is not None:
            raise ValueError(f"cuts apply only to layout='doc-zigzag', not {layout!r}: drop cuts")
        return
    if cuts is None:
        raise ValueError("layout='doc-zigzag' follows the batch's documents: pass cuts=document_cuts(segments, "
                         "key_keep), or shard the batch with seqpar.shard_batch(..., layout='doc-zigzag') and pass "
                         "its SeqShard (without layout) to the attention function")
    cuts = list(cuts)
    if any(not 0 < c < seq_len for c in cuts) or any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)):
        raise ValueError(f"cuts must be increasing positions inside (0, {seq_len}), got {cuts[:8]}"
                         f"{' ...' if len(cuts) > 8 else ''}: use document_cuts(segments, key_keep)")


def document_cuts(segments: Tensor | None, key_keep: Tensor | None = None) -> tuple[int, ...]:
    """Where ``"doc-zigzag"`` cuts the sequence: every position ``0 < j < S`` at which, in some row,
    a packed document starts or padding starts or ends.

    ``segments``: ``[B, S]`` document id of each token (None: one document per row); ``key_keep``:
    ``[B, S]`` bool, False marks padding (None: no padding); in the original token order. Returns
    the sorted positions (empty: nothing to cut). Raises ValueError for tensors not ``[B, S]``.
    """
    change = None
    shape = None
    for name, t in (("segments", segments), ("key_keep", key_keep)):
        if t is None:
            continue
        if t.dim() != 2 or (shape is not None and tuple(t.shape) != shape):
            raise ValueError(f"{name} must be [batch, seq_len] like the other mask, got shape {list(t.shape)}")
        shape = tuple(t.shape)
        starts = (t[:, 1:] != t[:, :-1]).any(dim=0)  # [S - 1]: a row changes between j - 1 and j
        change = starts if change is None else change | starts
    if change is None:
        return ()
    return tuple((change.nonzero().flatten() + 1).tolist())


def _doc_zigzag_owner(seq_len: int, ring: int, cuts: Sequence[int]) -> Tensor:
    """``[S]`` long: the ring rank that holds each token under ``"doc-zigzag"`` (module docstring)."""
    bounds = [0, *cuts, seq_len]
    held = [0] * ring  # tokens given to each ring rank so far
    head_next = [True] * ring  # where a ring rank's next single extra token goes: head or tail part
    part_len: list[int] = []
    part_owner: list[int] = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        base, extra = divmod(end - start, 2 * ring)
        lens = [base] * (2 * ring)
        for j, r in enumerate(sorted(range(ring), key=held.__getitem__)):  # the lightest ranks first
            if extra > j + ring:  # more extras than ring ranks: the lightest take two
                lens[r] += 1
                lens[2 * ring - 1 - r] += 1
            elif extra > j:
                lens[r if head_next[r] else 2 * ring - 1 - r] += 1
                head_next[r] = not head_next[r]
        for r in range(ring):
            held[r] += lens[r] + lens[2 * ring - 1 - r]
        part_len += lens
        part_owner += [*range(ring), *reversed(range(ring))]
    # the part of each token (searchsorted: repeat_interleave is slow here under a busy thread pool)
    ends = torch.tensor(part_len, dtype=torch.long).cumsum(0)
    return torch.tensor(part_owner, dtype=torch.long)[torch.searchsorted(ends, torch.arange(seq_len), right=True)]


def _ring_chunks(seq_len: int, ring: int, layout: str, cuts: Sequence[int] | None) -> list[Tensor]:
    """The tokens of each ring rank, in layout order (before the split over its ulysses ranks)."""
    tokens = torch.arange(seq_len)
    if layout == "zigzag":
        chunks = torch.tensor_split(tokens, 2 * ring)
        return [torch.cat([chunks[i], chunks[2 * ring - 1 - i]]) for i in range(ring)]
    owner = _doc_zigzag_owner(seq_len, ring, cuts or ())  # [S]
    return [tokens[owner == i] for i in range(ring)]


def layout_indices(seq_len: int, sp: int, layout: str = "contiguous", ulysses: int = 1,
                   cuts: Sequence[int] | None = None) -> list[Tensor]:
    """For each sp rank (ring-major), the global token indices it holds, in layout order.

    Returns ``sp`` long tensors whose concatenation is a permutation of ``range(seq_len)``. Any
    ``seq_len`` works, including ones shorter than the number of chunks (some ranks hold none).
    ``cuts`` (``"doc-zigzag"`` only, required there): :func:`document_cuts` of the batch. Raises
    ValueError for an unknown layout, a ``ulysses`` that does not divide ``sp`` or bad ``cuts``.
    """
    _check(seq_len, sp, layout, ulysses, cuts)
    if layout == "contiguous":
        return list(torch.tensor_split(torch.arange(seq_len), sp))
    out = []
    for ring_chunk in _ring_chunks(seq_len, sp // ulysses, layout, cuts):
        out.extend(torch.tensor_split(ring_chunk, ulysses))
    return out


def layout_permutation(seq_len: int, sp: int, layout: str = "contiguous", ulysses: int = 1,
                       cuts: Sequence[int] | None = None) -> Tensor:
    """``[S]`` long: the original index of each position of the layout (``SeqShard.positions``)."""
    return torch.cat(layout_indices(seq_len, sp, layout, ulysses, cuts))


def layout_seq_lens(seq_len: int, sp: int, layout: str = "contiguous", ulysses: int = 1,
                    cuts: Sequence[int] | None = None) -> tuple[int, ...]:
    """How many tokens each sp rank holds (``SeqShard.seq_lens``)."""
    return tuple(int(t.numel()) for t in layout_indices(seq_len, sp, layout, ulysses, cuts))


def min_seq_len(sp: int, layout: str = "contiguous", ulysses: int = 1) -> int:
    """The shortest sequence that leaves no sp rank without tokens (whatever the cuts of
    ``"doc-zigzag"``: its ring ranks' lengths differ by at most one). Raises as :func:`layout_indices`."""
    _check(0, sp, layout, ulysses, () if layout == "doc-zigzag" else None)
    if layout != "zigzag":
        return sp
    s = sp  # fewer tokens than ranks always leaves one empty; shard lengths only grow with s
    while min(layout_seq_lens(s, sp, layout, ulysses)) == 0:
        s += 1
    return s


def inverse_permutation(perm: Tensor) -> Tensor:
    """``inv`` with ``inv[perm[i]] = i``: ``x_layout[:, inv]`` restores the original order.

    Raises ValueError if ``perm`` is not a 1-D permutation of ``range(len(perm))``.
    """
    if perm.dim() != 1:
        raise ValueError(f"a permutation must be 1-D, got shape {list(perm.shape)}")
    n = perm.numel()
    inv = torch.full((n,), -1, dtype=torch.long, device=perm.device)
    if n:
        if int(perm.min()) < 0 or int(perm.max()) >= n:
            raise ValueError(f"not a permutation of range({n}): values outside [0, {n})")
        inv[perm.long()] = torch.arange(n, device=perm.device)
        if bool((inv < 0).any()):
            raise ValueError(f"not a permutation of range({n}): repeated values")
    return inv
