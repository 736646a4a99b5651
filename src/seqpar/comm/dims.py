"""The degrees of an N-D mesh, resolved and checked without communicating (pure arithmetic).

:func:`resolve_dims` turns the keyword arguments of :func:`seqpar.init_mesh` into one
:class:`MeshDims`, or raises the ValueError that says which option to change. Every rank calls it
with the same arguments and the same world size, so every rank raises alike, before any group is
created. Rank order, outermost first (torchtitan's ``ParallelDims`` order, pipeline aside)::

    dp_replicate  x  dp_shard  x  sp (= ring x ulysses)  x  tp
    across hosts                                          inside a host

tp is innermost: consecutive ranks (one host's GPUs) hold one tensor-parallel group, whose two
all-reduces per layer need the fastest links. sp comes next (Ulysses' all-to-alls want a host too;
ring tolerates slower links, so a hybrid puts ring outside ulysses), then the data-parallel
dimensions, whose gradient reduction is once per step. ep is not a dimension of its own: expert
parallelism borrows ``ep`` consecutive ranks of ``dp_shard x sp`` for the MoE layers (torchtitan's
and Megatron's "folding"), so ``ep`` must divide ``dp_shard * sp``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeshDims:
    """The degrees of a seqpar mesh. ``sp == ring * ulysses`` (a plain split has ``ring == 1``,
    ``ulysses == sp``; ``hybrid``: the mesh has ``ring`` and ``ulysses`` axes, as when either was
    given); ``dp == dp_replicate * dp_shard``; ``world == dp * sp * tp``; ``ep`` divides
    ``dp_shard * sp`` (1: no expert parallelism)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1
    ring: int = 1
    ulysses: int = 1
    hybrid: bool = False

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.sp * self.tp

    @property
    def grad_ranks(self) -> int:
        """How many ranks a gradient is averaged over: every dp x sp rank, never the tp ranks."""
        return self.dp * self.sp

    def describe(self) -> str:
        """``"dp_replicate=1 dp_shard=2 sp=2 (ring 1 x ulysses 2) tp=2 ep=1"``."""
        sp = f"sp={self.sp}" + (f" (ring {self.ring} x ulysses {self.ulysses})" if self.hybrid else "")
        return f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} {sp} tp={self.tp} ep={self.ep}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive integer")


def resolve_dims(world: int, *, sp: int | None = None, dp: int | None = None, dp_replicate: int | None = None,
                 dp_shard: int | None = None, tp: int | None = None, ulysses: int | None = None,
                 ring: int | None = None, ep: int | None = None) -> MeshDims:
    """The :class:`MeshDims` that ``init_mesh(**kwargs)`` builds over ``world`` ranks.

    Defaults: ``tp=1``, ``dp_replicate=1``, ``sp = ulysses * ring`` (1 when none is given), and
    ``dp_shard`` takes the ranks left (``world // (dp_replicate * sp * tp)``); ``dp`` alone is
    ``dp_shard``. Raises ValueError (naming the option and the values that work) when the degrees
    do not multiply to ``world``, ``dp`` disagrees with ``dp_replicate * dp_shard``, ``ulysses *
    ring != sp`` or ``ep`` does not divide ``dp_shard * sp``."""
    for name, value in (("sp", sp), ("dp", dp), ("dp_replicate", dp_replicate), ("dp_shard", dp_shard),
                        ("tp", tp), ("ulysses", ulysses), ("ring", ring), ("ep", ep)):
        _positive(name, value)
    hybrid = ulysses is not None or ring is not None  # a ring x ulysses mesh, as init_mesh has built it
    if sp is None:
        sp = (ulysses or 1) * (ring or 1)
    if ulysses is None:
        ulysses = sp // (ring or 1)
    if ring is None:
        ring = sp // ulysses
    if ulysses * ring != sp:
        raise ValueError(f"ulysses={ulysses} x ring={ring} = {ulysses * ring} != sp={sp}")
    tp = tp or 1
    if world % (sp * tp):
        raise ValueError(f"sp={sp} x tp={tp} = {sp * tp} must divide the world size {world}: choose sp x tp in "
                         f"{_divisors(world)}")
    rest = world // (sp * tp)  # the data-parallel ranks
    if dp is not None and dp_replicate is None and dp_shard is None:
        dp_shard = dp
    if dp is not None and dp_shard is not None and dp != (dp_replicate or 1) * dp_shard:
        raise ValueError(f"dp={dp} != dp_replicate={dp_replicate or 1} x dp_shard={dp_shard}: give dp or its two "
                         "factors, not both")
    dp_replicate = dp_replicate or 1
    if rest % dp_replicate:
        raise ValueError(f"dp_replicate={dp_replicate} must divide the {rest} data-parallel ranks (world {world} / "
                         f"(sp={sp} x tp={tp})): choose dp_replicate in {_divisors(rest)}")
    dp_shard = dp_shard if dp_shard is not None else rest // dp_replicate
    if dp_replicate * dp_shard != rest:
        raise ValueError(f"dp_replicate={dp_replicate} x dp_shard={dp_shard} x sp={sp} x tp={tp} = "
                         f"{dp_replicate * dp_shard * sp * tp} != world size {world}: set dp_shard="
                         f"{rest // dp_replicate} or omit it")
    if dp is not None and dp != dp_replicate * dp_shard:
        raise ValueError(f"dp={dp} != dp_replicate={dp_replicate} x dp_shard={dp_shard}: give dp or its two "
                         "factors, not both")
    ep = ep or 1
    if (dp_shard * sp) % ep:
        raise ValueError(f"ep={ep} must divide dp_shard x sp = {dp_shard} x {sp} = {dp_shard * sp}: expert "
                         f"parallelism borrows its ranks from dp_shard x sp; choose ep in {_divisors(dp_shard * sp)}")
    return MeshDims(dp_replicate=dp_replicate, dp_shard=dp_shard, sp=sp, tp=tp, ep=ep, ring=ring, ulysses=ulysses,
                    hybrid=hybrid)
