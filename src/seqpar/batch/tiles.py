"""How many tokens a tile holds: the one home of the tile sizes of :func:`seqpar.reduce_memory`'s
tiled MLP and of the objectives' vocabulary tiles. Pure arithmetic.

Both rules follow the shard: a tile's intermediate stays within what the shard's own hidden states
``[T, H]`` hold, so that the fixed cost of a tile never dominates a rank's memory and that memory
keeps shrinking with sp. Both are clamped to ``[MIN_TILE, cap]``: below :data:`MIN_TILE` tokens a
matmul runs too thin to pay; the cap bounds a tile on a wide shard.
"""

from __future__ import annotations

MIN_TILE = 64
"""The fewest tokens a chosen tile holds: below this a tile's matmul runs too thin to pay."""
DEFAULT_LOSS_TILE = 1024
"""Tokens per loss tile: a [1024, V] float32 tile is 128 MiB at a 32k vocabulary, 512 MiB at 128k."""
MAX_MLP_TILE = 2048
"""The most tokens an MLP tile holds: a gated MLP's intermediates at most [B, 2048, 3 x intermediate]."""


def mlp_tile_for(tokens: int, hidden: int, intermediate: int) -> int:
    """Tokens per tile of the tiled MLP on a shard of ``tokens`` positions of width ``hidden``: the
    most whose ``[tile, intermediate]`` intermediate holds no more than the shard's ``[tokens, hidden]``
    hidden states (``tile * I <= T * H``), within ``[MIN_TILE, MAX_MLP_TILE]``."""
    return max(MIN_TILE, min(MAX_MLP_TILE, tokens * hidden // intermediate))


def vocab_tile(tokens: int, hidden: int, vocab: int, *, cap: int = DEFAULT_LOSS_TILE) -> int:
    """Tokens per vocabulary tile for a shard of ``tokens`` hidden states of width ``hidden``: the
    most whose ``[T, V]`` buffer holds no more than half the hidden states ``[N, H]``
    (``2 T V <= N H``), within ``[MIN_TILE, cap]``."""
    return max(MIN_TILE, min(cap, tokens * hidden // (2 * vocab)))
