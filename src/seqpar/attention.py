"""One entry point for sequence-parallel attention over a mesh, whatever the strategy.

Strategies register themselves in :data:`STRATEGIES`: ``fn(q, k, v, *, mesh, spec_kwargs..., kernel,
shard, validate) -> out``, all in the ``[B, S_local, H, D]`` layout. The HF integration and the CLI
go through :func:`sp_attention`, so a new strategy needs no change there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from .mesh import Axis, MeshOrGroup, axis_group, axis_size, has_axis
from .meta import SeqShard

STRATEGIES: dict[str, Callable[..., Tensor]] = {}


def register_strategy(name: str) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    def deco(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        STRATEGIES[name] = fn
        return fn
    return deco


@register_strategy("ulysses")
def _ulysses(q: Tensor, k: Tensor, v: Tensor, *, mesh: MeshOrGroup, kernel: Any = None, **kw: Any) -> Tensor:
    from .ulysses import ulysses_attention

    return ulysses_attention(q, k, v, group=axis_group(mesh, Axis.SP.value), kernel=kernel or "sdpa", **kw)


@register_strategy("ring")
def _ring(q: Tensor, k: Tensor, v: Tensor, *, mesh: MeshOrGroup, **kw: Any) -> Tensor:
    from .ring import ring_attention

    return ring_attention(q, k, v, group=axis_group(mesh, Axis.SP.value), **kw)


@register_strategy("hybrid")
def _hybrid(q: Tensor, k: Tensor, v: Tensor, *, mesh: MeshOrGroup, **kw: Any) -> Tensor:
    from .hybrid import hybrid_attention

    return hybrid_attention(q, k, v, ulysses_group=axis_group(mesh, Axis.ULYSSES.value),
                            ring_group=axis_group(mesh, Axis.RING.value), **kw)


def resolve_strategy(strategy: str, mesh: MeshOrGroup, num_heads: int) -> str:
    """The strategy ``"auto"`` stands for on ``mesh`` (other names are returned as they are).

    A mesh built with ``ulysses`` and ``ring`` axes (``seqpar.init_mesh(sp=, ulysses=, ring=)``,
    e.g. from ``seqpar.plan(...).mesh_kwargs()``) runs ``"hybrid"``; otherwise ``"ulysses"`` while
    every rank gets at least one query head (sp <= heads: it moves less and has no cap on kernels),
    else ``"ring"``, which has no head limit. Pure: no communication.
    """
    if strategy != "auto":
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}: choose one of {sorted([*STRATEGIES, 'auto'])}")
        return strategy
    if has_axis(mesh, Axis.ULYSSES.value) and has_axis(mesh, Axis.RING.value):
        return "hybrid"
    return "ulysses" if axis_size(mesh, Axis.SP.value) <= num_heads else "ring"


def sp_attention(q: Tensor, k: Tensor, v: Tensor, *, mesh: MeshOrGroup, strategy: str = "ulysses",
                 causal: bool = False, scale: float | None = None, window: int | None = None,
                 softcap: float | None = None, dropout: float = 0.0, kernel: Any = None,
                 shard: SeqShard | None = None, validate: bool = True) -> Tensor:
    """Sequence-parallel attention with the named strategy over ``mesh`` (layouts as
    :func:`seqpar.ulysses_attention`). Raises ValueError for an unknown strategy."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[strategy](q, k, v, mesh=mesh, causal=causal, scale=scale, window=window, softcap=softcap,
                                dropout=dropout, kernel=kernel, shard=shard, validate=validate)
