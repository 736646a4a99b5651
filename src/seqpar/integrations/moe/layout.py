"""Which ranks form an expert-parallel group, and which hold the same experts: EP folded over dp x sp.

Expert parallelism borrows its ranks from the ranks that already replicate the dense layers -- the
dp x sp ranks of the model's mesh --, as torchtitan (ep taken from dp_shard x cp) and Megatron ("MoE
parallel folding") do: it is not a set of ranks of its own. The contract of ``apply_ep``'s ``ep``:

    ep   a ProcessGroup, or a 1-D DeviceMesh, that this rank belongs to, whose ranks are a subset of
         the dp x sp ranks of ``mesh``; over all the ranks of that mesh the ep groups are disjoint,
         cover it and have one size. Every rank of the world calls apply_ep together (it creates
         process groups, as ``dist.new_group`` does).

    dp x sp = 2 x 2, ep = 2 over sp        mesh [[0, 1], [2, 3]], ep groups {0, 1} and {2, 3}
        rank        0      1      2      3
        experts    0-1    2-3    0-1    2-3                          (E = 4)
        replicas   {0, 2} hold experts 0-1, {1, 3} hold experts 2-3  (dp x sp / ep = 2 ranks each)

Ep rank j of every ep group of one mesh holds the same experts: those ranks (one per ep group) are
the experts' *replicas*, and their gradients are averaged over them as the dense layers' are over
the whole mesh (:mod:`seqpar.batch.grad_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

Table = list[tuple[tuple[int, ...], tuple[int, ...]]]
"""Per world rank: ``(its mesh's ranks, sorted; its ep group's ranks, in ep-rank order)``."""


@dataclass(frozen=True)
class EPLayout:
    """This rank's expert-parallel groups: ``group`` (the ep group: tokens travel inside it),
    ``replicas`` (the ranks holding the same experts: gradients are averaged over it), ``size``
    (ep) and ``rank`` (this rank's index in ``group``). Shared, never copied: a deep copy of a
    model keeps the same process groups."""

    group: dist.ProcessGroup
    replicas: dist.ProcessGroup
    size: int
    rank: int

    def __deepcopy__(self, memo: dict[int, Any]) -> EPLayout:
        return self


def ep_group(ep: object) -> dist.ProcessGroup:
    """The process group of ``ep`` (a ProcessGroup, or a 1-D DeviceMesh). Raises ValueError otherwise."""
    if isinstance(ep, DeviceMesh):
        if ep.ndim != 1:
            raise ValueError(f"ep must be a 1-D DeviceMesh (the expert-parallel ranks), got a {ep.ndim}-D mesh "
                             f"{ep.mesh_dim_names}: pass mesh[\"ep\"]")
        return ep.get_group()
    if isinstance(ep, dist.ProcessGroup):
        return ep
    raise ValueError(f"ep must be a ProcessGroup or a 1-D DeviceMesh, got {type(ep).__name__}")


def fold_problem(table: Table) -> str | None:
    """Why ``table`` breaks the contract of the module doc, or None. Pure: every rank, given the
    same table, finds the same problem."""
    for r, (mesh, group) in enumerate(table):
        if r not in group:
            return f"rank {r} is not in the ep group it passed ({list(group)})"
        if not set(group) <= set(mesh):
            return (f"rank {r}'s ep group {list(group)} is not inside its mesh's dp x sp ranks {list(mesh)}: expert "
                    "parallelism folds over the ranks that hold the dense layers, it has no ranks of its own")
        for q in group:
            if table[q][1] != group:
                return f"ranks {r} and {q} passed different ep groups: {list(group)} and {list(table[q][1])}"
            if table[q][0] != mesh:
                return (f"ranks {r} and {q} share an ep group but passed different meshes: {list(mesh)}, "
                        f"{list(table[q][0])}")
    for r, (mesh, _) in enumerate(table):
        for q in mesh:
            if q >= len(table) or table[q][0] != mesh:
                return f"ranks {r} and {q} disagree on the mesh's ranks"
        sizes = {len(table[q][1]) for q in mesh}
        if len(sizes) != 1:
            return f"the ep groups over mesh ranks {list(mesh)} have different sizes {sorted(sizes)}: choose one ep"
    return None


def replica_ranks(table: Table) -> list[list[int]]:
    """The ranks holding the same experts, as lists of world ranks: for each mesh, ep rank j of
    every ep group of it (the table must pass :func:`fold_problem`)."""
    out, seen = [], set()
    for mesh, _ in table:
        if mesh in seen:
            continue
        seen.add(mesh)
        groups = list(dict.fromkeys(table[q][1] for q in mesh))  # the mesh's ep groups, first-seen order
        out += [sorted(g[j] for g in groups) for j in range(len(groups[0]))]
    return out


def fold(ep: object, mesh: DeviceMesh) -> EPLayout:
    """This rank's :class:`EPLayout` for ``ep`` folded over ``mesh``'s dp x sp ranks. Collective over
    the world (one object all-gather, then the replica groups are created). Raises ValueError, the
    same on every rank, when the ranks break the contract (module doc)."""
    group = ep_group(ep)
    ranks = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
    table: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(table, (ranks, tuple(dist.get_process_group_ranks(group))))
    table = [(tuple(m), tuple(g)) for m, g in table]
    problem = fold_problem(table)
    if problem is not None:
        raise ValueError(f"seqpar: expert parallelism: {problem}")
    replicas, _ = dist.new_subgroups_by_enumeration(replica_ranks(table))
    return EPLayout(group, replicas, dist.get_world_size(group), dist.get_rank(group))
