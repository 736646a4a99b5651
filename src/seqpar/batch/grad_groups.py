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

    register_finder(finder)      finder(model) -> [ShardedParams(params, group, what), ...]
    sharded_params(model)        every finder's answer for one model
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class ShardedParams:
    """``params``: parameters this rank holds a shard of; ``group``: the ranks that hold the same
    shards (their gradients are averaged over it, and over nothing else); ``what``: in words."""

    params: tuple[nn.Parameter, ...]
    group: dist.ProcessGroup
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
