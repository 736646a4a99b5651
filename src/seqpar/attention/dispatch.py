"""One entry point for sequence-parallel attention over a mesh, whatever the strategy.

:data:`STRATEGIES` maps a name to ``fn(q, k, v, *, mesh, groups=None, **options) -> out`` (options:
:class:`~seqpar.attention.call.RingOptions`), all in the ``[B, S_local, H, D]`` layout; each entry
runs the shared pipeline (:func:`~seqpar.attention.call.prepare`, :func:`~seqpar.attention.run.run`)
on the process groups of its strategy's mesh axes (:data:`AXES`, :func:`mesh_groups`; a caller
that looked them up already passes ``groups``). The HF integration and the CLI go through
:data:`STRATEGIES`, so a new strategy is one entry here and its groups' shape in the pipeline,
nothing elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import Unpack

from ..comm.mesh import Axis, as_mesh, axis_group, axis_size, grad_group, has_axis
from .call import Groups, RingOptions, prepare
from .run import run

AXES: dict[str, tuple[str | None, str | None]] = {
    "ulysses": (Axis.SP.value, None),
    "ring": (None, Axis.SP.value),
    "hybrid": (Axis.ULYSSES.value, Axis.RING.value),
}
"""Each strategy's ``(ulysses axis, ring axis)`` on a seqpar mesh: heads split over the first, K/V
travelling around the second."""


@torch.compiler.disable  # dynamo cannot read the grad groups seqpar keeps on a mesh: look them up once, outside
def mesh_groups(mesh: DeviceMesh, strategy: str) -> Groups:
    """The process groups ``strategy`` runs on over ``mesh`` (ring: with its grad group). Called
    inside ``torch.compile`` it is a graph break: :func:`seqpar.parallelize` looks them up once."""
    u_axis, r_axis = AXES[strategy]
    return Groups(ulysses=None if u_axis is None else axis_group(mesh, u_axis),
                  ring=None if r_axis is None else axis_group(mesh, r_axis),
                  ring_grad=None if r_axis is None else grad_group(mesh, r_axis), mesh=mesh, axes=(u_axis, r_axis),
                  sp=axis_group(mesh, Axis.SP.value) if strategy == "hybrid" and has_axis(mesh, Axis.SP.value)
                  else None)


def _entry(strategy: str) -> Callable[..., Tensor]:
    def attention(q: Tensor, k: Tensor, v: Tensor, *, mesh: DeviceMesh, groups: Groups | None = None,
                  **options: Any) -> Tensor:
        groups = mesh_groups(mesh, strategy) if groups is None else groups
        return run(prepare(q, k, v, groups, options, caller="sp_attention"), q, k, v)

    attention.__name__ = f"{strategy}_over_mesh"
    return attention


STRATEGIES: dict[str, Callable[..., Tensor]] = {name: _entry(name) for name in AXES}

ONE_AXIS = tuple(name for name, axes in AXES.items() if Axis.SP.value in axes)
"""The strategies that run on the one ``sp`` axis (not a 2-D ulysses x ring mesh): those a sub-group
of the SP ranks can run on its own (a dynamic schedule's bins)."""


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
                 **options: Unpack[RingOptions]) -> Tensor:
    """Sequence-parallel attention with the named strategy over ``mesh`` (a DeviceMesh from
    :func:`seqpar.init_mesh`).

    ``q [B, S_local, H, D]``, ``k [B, S_local, H_kv, D]``, ``v [B, S_local, H_kv, Dv]`` -> a
    contiguous ``[B, S_local, H, Dv]``; ``options``: everything the strategies take
    (:class:`~seqpar.attention.call.RingOptions`: spec options, kernel, masks or the batch's shard,
    layout, validate; ``comm`` and ``stats`` where the strategy runs a ring). ``strategy``:
    ``"ulysses"``, ``"ring"``, ``"hybrid"`` or ``"auto"`` (:func:`resolve_strategy`). Raises
    ValueError for an unknown strategy, a mesh without the axes the strategy needs, or ring
    options for a strategy without a ring.
    """
    strategy = resolve_strategy(strategy, as_mesh(mesh, "sp_attention"), q.shape[2])
    if AXES[strategy][1] is None:
        given = [name for name in ("comm", "stats") if options.get(name) is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} describe a ring, and strategy {strategy!r} runs none: drop "
                             "them, or use strategy='ring' or 'hybrid'")
        options = {name: value for name, value in options.items() if name not in ("comm", "stats")}
    return STRATEGIES[strategy](q, k, v, mesh=mesh, **options)
