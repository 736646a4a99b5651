"""One entry point for sequence-parallel attention over a mesh, whatever the strategy.

:data:`STRATEGIES` maps a name to ``fn(q, k, v, *, mesh, spec keywords..., kernel, shard, validate)
-> out``, all in the ``[B, S_local, H, D]`` layout; each entry turns the mesh into the process
groups its strategy takes. The HF integration and the CLI go through :func:`sp_attention`, so a new
strategy is one entry here and nothing elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..comm.mesh import Axis, as_mesh, axis_group, axis_size, grad_group, has_axis
from .hybrid import hybrid_attention
from .kernels import KernelArg
from .ring import ring_attention
from .shard import SeqShard
from .ulysses import ulysses_attention


def _ulysses(q: Tensor, k: Tensor, v: Tensor, *, mesh: DeviceMesh, **kw: Any) -> Tensor:
    return ulysses_attention(q, k, v, group=axis_group(mesh, Axis.SP.value), **kw)


def _ring(q: Tensor, k: Tensor, v: Tensor, *, mesh: DeviceMesh, **kw: Any) -> Tensor:
    return ring_attention(q, k, v, group=axis_group(mesh, Axis.SP.value), grad_group=grad_group(mesh, Axis.SP.value),
                          **kw)


def _hybrid(q: Tensor, k: Tensor, v: Tensor, *, mesh: DeviceMesh, **kw: Any) -> Tensor:
    return hybrid_attention(q, k, v, ulysses_group=axis_group(mesh, Axis.ULYSSES.value),
                            ring_group=axis_group(mesh, Axis.RING.value),
                            ring_grad_group=grad_group(mesh, Axis.RING.value), **kw)


STRATEGIES: dict[str, Callable[..., Tensor]] = {"ulysses": _ulysses, "ring": _ring, "hybrid": _hybrid}


def check_strategy(strategy: str) -> None:
    """Raise ValueError unless ``strategy`` is one of :data:`STRATEGIES` or ``"auto"``."""
    if strategy != "auto" and strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {sorted([*STRATEGIES, 'auto'])}")


def resolve_strategy(strategy: str, mesh: DeviceMesh, num_heads: int) -> str:
    """The strategy ``"auto"`` stands for on ``mesh`` (other names are returned as they are).

    A mesh built with ``ulysses`` and ``ring`` axes (``seqpar.init_mesh(sp=, ulysses=, ring=)``,
    e.g. from ``seqpar.plan(...).mesh_kwargs()``) runs ``"hybrid"``; otherwise ``"ulysses"`` while
    every rank gets at least one query head (sp <= heads: it moves less and has no cap on kernels),
    else ``"ring"``, which has no head limit. Pure: no communication.
    """
    check_strategy(strategy)
    if strategy != "auto":
        return strategy
    if has_axis(mesh, Axis.ULYSSES.value) and has_axis(mesh, Axis.RING.value):
        return "hybrid"
    return "ulysses" if axis_size(mesh, Axis.SP.value) <= num_heads else "ring"


def sp_attention(q: Tensor, k: Tensor, v: Tensor, *, mesh: DeviceMesh, strategy: str = "ulysses",
                 causal: bool = False, scale: float | None = None, window: int | None = None,
                 softcap: float | None = None, chunk: int | None = None, sinks: Tensor | None = None,
                 dropout: float = 0.0, kernel: KernelArg | None = None,
                 shard: SeqShard | None = None, validate: bool = True) -> Tensor:
    """Sequence-parallel attention with the named strategy over ``mesh`` (a DeviceMesh from
    :func:`seqpar.init_mesh`).

    ``q [B, S_local, H, D]``, ``k [B, S_local, H_kv, D]``, ``v [B, S_local, H_kv, Dv]`` -> a
    contiguous ``[B, S_local, H, Dv]``; options (``chunk``, ``sinks [H]`` included) as
    :func:`seqpar.ulysses_attention`; ``strategy``: ``"ulysses"``, ``"ring"``, ``"hybrid"`` or
    ``"auto"`` (:func:`resolve_strategy`). Raises ValueError for an unknown strategy or a mesh
    without the axes the strategy needs.
    """
    strategy = resolve_strategy(strategy, as_mesh(mesh, "sp_attention"), q.shape[2])
    return STRATEGIES[strategy](q, k, v, mesh=mesh, causal=causal, scale=scale, window=window, softcap=softcap,
                                chunk=chunk, sinks=sinks, dropout=dropout, kernel=kernel, shard=shard,
                                validate=validate)
