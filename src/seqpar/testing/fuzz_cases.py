"""The cases of the seeded fuzz (:mod:`seqpar.testing.fuzz`): what one seed draws, and one rank's outcome."""

from __future__ import annotations

import random
from dataclasses import dataclass

ATTN_ODD = ("dtype", "heads", "head_dim", "batch", "mask-given", "mask-shape", "causal", "window", "strategy",
            "seq-k", "layout")
# Ranks that disagree on the strategy run on one mesh (the majority's): hybrid's validation agrees over the
# mesh's whole sp group, the group Ulysses and ring check over, so hybrid against either is a ValueError too.
# A known limit, not drawn: ranks passing different meshes (no group in common) meet at the process-group
# timeout on every rank, not in a ValueError.
MODEL_ODD = ("ids", "seq", "layout", "mask-given", "items", "labels", "strategy")


@dataclass(frozen=True)
class FuzzCase:
    """One drawn case (:func:`draw`); ``odd`` names what ``odd_rank`` alone gets different."""

    seed: int
    world: int
    target: str  # "attention" | "model"
    strategy: str
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    window: int | None
    mask: str  # none | right | left | empty-row | packed | packed-pad | cu_seqlens
    dtype: str
    layout: str
    labels: str  # ok | ignored | short (model cases)
    odd: str | None
    odd_rank: int

    def label(self) -> str:
        odd = f" odd={self.odd}@{self.odd_rank}" if self.odd else ""
        extra = f" window={self.window}" if self.window else ""
        labels = f" labels={self.labels}" if self.target == "model" else ""
        return (f"seed={self.seed} P={self.world} {self.target} {self.strategy}/{self.layout} B={self.batch} "
                f"S={self.seq} H={self.heads}/{self.kv_heads} D={self.head_dim} {self.dtype} causal={int(self.causal)}"
                f"{extra} mask={self.mask}{labels}{odd}")

    @property
    def invalid(self) -> str | None:
        """What makes the case bad input as a whole (a ValueError is then required), or None."""
        if self.odd:
            return f"odd {self.odd}"
        if self.labels == "short":
            return "labels shape"
        return None


def draw(seed: int, world: int) -> FuzzCase:
    """The case of ``seed`` on ``world`` ranks: pure, the same on every rank."""
    rng = random.Random(seed * 1_000_003 + world)
    target = rng.choice(("attention", "attention", "model"))
    strategies = ["ulysses", "ring"] + (["hybrid"] if world == 4 else [])
    strategy = rng.choice(strategies)
    seq = rng.choice((1, world - 1 or 1, world, world + 1, 7, 13, 2 * world + 1, 24, 37))
    heads = rng.choice((1, 2, 3, 4, 6, 8))
    kv_heads = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    causal = target == "model" or rng.random() < 0.6
    window = rng.choice((None, None, 3)) if target == "attention" and causal else None
    if target == "attention":
        mask = rng.choice(("none", "right", "left", "empty-row", "packed", "packed-pad"))
        dtype = rng.choice(("float64", "float64", "float32"))
        layout = rng.choice(("contiguous", "zigzag"))
        labels, head_dim = "ok", rng.choice((4, 8))
    else:
        mask = rng.choice(("none", "right", "left", "empty-row", "packed", "cu_seqlens"))
        dtype, layout, head_dim = "float64", rng.choice(("contiguous", "zigzag", "doc-zigzag")), 8
        labels = rng.choice(("ok", "ok", "ok", "ignored", "short"))
    odd = rng.choice(ATTN_ODD if target == "attention" else MODEL_ODD) if rng.random() < 0.35 else None
    return FuzzCase(seed, world, target, strategy, rng.choice((1, 2, 3)), seq, heads, kv_heads, head_dim, causal,
                    window, mask, dtype, layout, labels, odd, rng.randrange(world))


@dataclass(frozen=True)
class Outcome:
    """One rank's end of a case: ``kind`` "exact", "inexact", "ValueError" or another exception's
    type name ("timeout" when the process group timed out); ``detail``: the error or message."""

    kind: str
    detail: str = ""
