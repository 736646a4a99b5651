"""FSDP2 and DDP over the dp x sp ranks, with the gradient reduction the seqpar loss needs: a sum.

The seqpar loss gives each rank the gradient of its own share (see :mod:`seqpar.batch.loss`), so the
parameter gradients must be *summed* over all dp x sp ranks. FSDP2 and DDP average by default
(they divide by the number of ranks): that would scale every gradient by ``1 / (dp * sp)``. Here
FSDP2 gets a gradient divide factor of 1 (``set_gradient_divide_factor``) and DDP a communication
hook that all-reduces without dividing -- both public torch APIs. The dp average, when the loss is
a per-dp-rank mean, is already folded into the loss's gradient scale.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .. import compat
from ..comm.mesh import as_mesh


def dp_sp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """One process group over every rank of ``mesh`` (dp x sp, hybrid axes included).

    The whole world when the mesh spans it (no new group); otherwise a new group, which, like
    ``dist.new_group``, every rank of the world must create together.
    """
    ranks = sorted(int(r) for r in as_mesh(mesh, "dp_sp_group").mesh.flatten().tolist())
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks)


def dp_sp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A 1-D DeviceMesh named ``"dp_sp"`` over every rank of ``mesh`` (what FSDP2 shards over)."""
    return DeviceMesh.from_group(dp_sp_group(mesh), mesh.device_type, mesh_dim_names=("dp_sp",))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, **fully_shard_kwargs: Any) -> nn.Module:
    """FSDP2 over all dp x sp ranks: ``fully_shard`` each decoder block, then the root, with
    gradients summed (not averaged) over the ranks. Call after :func:`seqpar.parallelize`.

    Gradients then equal the non-parallel model's (as DTensors sharded over the ranks). Extra
    keywords go to ``fully_shard`` (``mp_policy``, ``reshard_after_forward``, ...).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    flat = dp_sp_mesh(mesh)
    blocks = compat.decoder_block_classes(model)
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=flat, **fully_shard_kwargs)
    fully_shard(model, mesh=flat, **fully_shard_kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
            else:  # torch < 2.6 names it after the reduce-scatter
                module.set_reduce_scatter_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                # a divide factor of 1 otherwise becomes PREMUL_SUM in fp32/bf16, which gloo lacks
                module.set_force_sum_reduction_for_comms(True)
    return model


def _sum_allreduce_hook(group, bucket):  # no annotations: DDP compares them to the real classes, not strings
    """DDP communication hook: all-reduce the bucket and keep the sum (the default divides)."""
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def apply_ddp(model: nn.Module, mesh: DeviceMesh, **ddp_kwargs: Any) -> nn.parallel.DistributedDataParallel:
    """DDP over all dp x sp ranks with gradients summed, not averaged. Call after
    :func:`seqpar.parallelize`; returns the DDP wrapper (``ddp(**local)`` works as ``model(**local)``)."""
    group = dp_sp_group(mesh)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, **ddp_kwargs)
    ddp.register_comm_hook(group, _sum_allreduce_hook)
    return ddp
