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

The concatenation of all ranks' indices is the layout permutation (``SeqShard.positions``); a
tensor in layout order goes back to the original order with the inverse permutation.
"""

from __future__ import annotations

import torch
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")


def _check(seq_len: int, sp: int, layout: str, ulysses: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {list(LAYOUTS)}")
    if not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be a non-negative int, got {seq_len!r}")
    if not isinstance(sp, int) or sp < 1:
        raise ValueError(f"sp (the sequence-parallel degree) must be a positive int, got {sp!r}")
    if not isinstance(ulysses, int) or ulysses < 1 or sp % ulysses:
        raise ValueError(f"ulysses={ulysses!r} must be a positive divisor of sp={sp}: choose ulysses in "
                         f"{[d for d in range(1, sp + 1) if sp % d == 0]}")


def layout_indices(seq_len: int, sp: int, layout: str = "contiguous", ulysses: int = 1) -> list[Tensor]:
    """For each sp rank (ring-major), the global token indices it holds, in layout order.

    Returns ``sp`` long tensors whose concatenation is a permutation of ``range(seq_len)``. Any
    ``seq_len`` works, including ones shorter than the number of chunks (some ranks hold none).
    Raises ValueError for an unknown layout or a ``ulysses`` that does not divide ``sp``.
    """
    _check(seq_len, sp, layout, ulysses)
    tokens = torch.arange(seq_len)
    if layout == "contiguous":
        return list(torch.tensor_split(tokens, sp))
    ring = sp // ulysses
    chunks = torch.tensor_split(tokens, 2 * ring)
    out = []
    for i in range(ring):
        ring_chunk = torch.cat([chunks[i], chunks[2 * ring - 1 - i]])
        out.extend(torch.tensor_split(ring_chunk, ulysses))
    return out


def layout_permutation(seq_len: int, sp: int, layout: str = "contiguous", ulysses: int = 1) -> Tensor:
    """``[S]`` long: the original index of each position of the layout (``SeqShard.positions``)."""
    return torch.cat(layout_indices(seq_len, sp, layout, ulysses))


def layout_seq_lens(seq_len: int, sp: int, layout: str = "contiguous", ulysses: int = 1) -> tuple[int, ...]:
    """How many tokens each sp rank holds (``SeqShard.seq_lens``)."""
    return tuple(int(t.numel()) for t in layout_indices(seq_len, sp, layout, ulysses))


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
