"""Parameters that not every rank holds, and the ranks that average their gradients.

Every parameter of a sequence-parallel model is replicated over the dp x sp ranks, and seqpar's
loss makes the average of its gradient over them exact (:mod:`seqpar.batch.loss`). Expert
parallelism breaks that for the experts: each rank holds a shard of them, and a shard is a
different tensor on each rank of its expert-parallel group -- averaging it over every rank would mix
different experts. Its gradient is averaged over the ranks that hold the *same* shard instead (its
scale is set so that this average is exact, :mod:`seqpar.integrations.moe.expert_parallel`).

What shards parameters this way says so through a *finder* registered here once, at import (a
registration point, as transformers' ``AttentionInterface`` is), so that :func:`seqpar.sync_gradients`
and the wrapper checks of :mod:`seqpar.integrations.distributed.fsdp` reduce each parameter over its
own ranks without importing the integration that sharded it (it sits above them)::

    register_finder(finder)      finder(model) -> [ShardedParams(params, group, peers, what), ...]
    sharded_params(model)        every finder's answer for one model
    total_grad_norm(model)       the whole model's gradient norm, the same on every rank

The norm a step clips with must count every shard once: after :func:`seqpar.sync_gradients` a
replicated parameter's gradient is whole on every rank, but a rank holds only its own experts', so
their squares are summed over the ranks that hold the others (``peers``) -- the local norm alone
undercounts them, and differs from rank to rank (Megatron-LM#5916's undercount, with EP and TP).
A DTensor gradient (tensor parallelism, FSDP2, both) says itself where its other parts are: its
local squares are summed over every mesh dimension it is sharded on, and over none it is
replicated on (:func:`dtensor_norm_part`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm import collectives


@dataclass(frozen=True)
class ShardedParams:
    """``params``: parameters this rank holds a shard of; ``group``: the ranks that hold the same
    shards (their gradients are averaged over it, and over nothing else); ``peers``: the ranks that
    hold the other shards (together, one whole copy); ``what``: in words."""

    params: tuple[nn.Parameter, ...]
    group: dist.ProcessGroup
    peers: dist.ProcessGroup
    what: str


Finder = Callable[[nn.Module], list[ShardedParams]]
_FINDERS: list[Finder] = []


def register_finder(finder: Finder) -> None:
    """Add ``finder`` (once; registering the same function again does nothing)."""
    if finder not in _FINDERS:
        _FINDERS.append(finder)


def sharded_params(model: nn.Module) -> list[ShardedParams]:
    """Every registered finder's sharded parameters of ``model`` ([] for a model nothing sharded)."""
    return [s for finder in _FINDERS for s in finder(model)]


def total_grad_norm(model: nn.Module, norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of ``model``'s whole gradient (a 0-d float64 tensor, the same on every
    rank; call after :func:`seqpar.sync_gradients`): each replicated parameter once, each sharded
    one over all its shards (one all-reduce over its ``peers`` per sharding). Clip with it
    (``torch.nn.utils.clip_grads_with_norm_``). Parameters without a gradient count as zeros."""
    inf = math.isinf(norm_type)
    sharded = sharded_params(model)
    own = {id(p) for s in sharded for p in s.params}
    grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in own]
    plain = [g for g in grads if not _is_dtensor(g)]
    device = plain[0].device if plain else grads[0].to_local().device if grads else torch.device("cpu")
    total = _norm_part(plain, norm_type, device)
    part = dtensor_norm_part([g for g in grads if _is_dtensor(g)], norm_type, device)
    total = torch.maximum(total, part) if inf else total + part
    for s in sharded:  # this rank's shards, then every peer's
        part = _norm_part([p.grad for p in s.params if p.grad is not None], norm_type, collectives.comm_device(s.peers))
        collectives.all_reduce(part, group=s.peers, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        part = part.to(total.device)
        total = torch.maximum(total, part) if inf else total + part
    return total if inf else total ** (1.0 / norm_type)


def _norm_part(grads: list[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """``max |g|`` (inf-norm) or ``sum |g| ** p`` over ``grads``, in float64, a 0-d tensor on ``device``."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g.detach().double(), norm_type).to(device) for g in grads])
    return norms.max() if math.isinf(norm_type) else (norms ** norm_type).sum()


def _is_dtensor(t: Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def dtensor_norm_part(grads: list[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """``max |g|`` or ``sum |g| ** p`` over DTensor gradients ``grads`` (float64, 0-d, the same on
    every rank): each one's local part, reduced over the mesh dimensions it is sharded on (the other
    ranks there hold the other parts) and over none it is replicated on (they hold the same). One
    all-reduce per (mesh, sharded dimension). Raises AssertionError for a ``Partial`` gradient (a
    sum not made yet: an internal error of what produced it)."""
    inf = math.isinf(norm_type)
    total = torch.zeros((), dtype=torch.float64, device=device)
    groups: dict[tuple[int, tuple[int, ...]], tuple[list[Tensor], object]] = {}
    for g in grads:
        assert not any(p.is_partial() for p in g.placements), "a partial DTensor gradient"
        # sharded: Shard, and FSDP2's _StridedShard over a TP shard (which is not a Shard to is_shard())
        dims = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
        groups.setdefault((id(g.device_mesh), dims), ([], g.device_mesh))[0].append(g.to_local())
    for (_, dims), (local, mesh) in groups.items():
        part = _norm_part(local, norm_type, local[0].device)
        for dim in dims:
            collectives.all_reduce(part, group=mesh.get_group(dim), op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        part = part.to(device)
        total = torch.maximum(total, part) if inf else total + part
    return total
