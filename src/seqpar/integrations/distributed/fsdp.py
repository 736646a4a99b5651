"""FSDP2 and DDP over the dp x sp ranks: the stock wrappers, averaging as they always do.

The seqpar loss scales each rank's share of the gradient by the number of ranks (see
:mod:`seqpar.batch.loss`), so the *average* of the parameter gradients over every dp x sp rank --
what DDP and FSDP2 compute by default, as in torchtitan, Megatron, DeepSpeed and accelerate -- is
exactly the non-parallel model's gradient. Any stock wrapper over those ranks works::

    DistributedDataParallel(model)                    the world is the mesh's dp x sp ranks
    fully_shard(block, mesh=flat); fully_shard(model, mesh=flat)    flat: 1-D over dp x sp
    accelerate's DDP / FSDP2, transformers' Trainer    (over every process)

:func:`apply_fsdp` and :func:`apply_ddp` are shorthands for the first two with ``mesh``'s ranks.

On an N-D mesh (``seqpar.init_mesh(dp_shard=, tp=, ...)``) the ranks gradients are averaged over
are the ``"dp_sp"`` view at this rank's tp index, never the tp ranks (whose gradients are shards or
whole copies, :mod:`.tensor_parallel`): :func:`apply_fsdp` shards over ``"dp_sp"`` -- with
dp_replicate > 1 as HSDP, replicated over ``"dp_replicate"`` and sharded over ``"dp_shard_sp"``
-- on the same root mesh as the tp axis, so a TP DTensor becomes FSDP2's 2-D (dp, tp) parameter.
A wrapper that reduces over only part of the ranks (FSDP over the dp axis alone, DDP over the dp
group) would leave the sp ranks' shares uncombined: :func:`check_gradient_reduction` refuses it at
the model's first training forward, on every rank, before any gradient exists -- and so it refuses
either wrapper around a model whose experts are sharded by expert parallelism (their shards average
over other ranks: :func:`seqpar.sync_gradients` does that); :func:`apply_ddp` refuses it before DDP's
constructor broadcasts rank 0's experts over the other ranks' (a stock DDP built by hand does that
before its first forward is refused: build none).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ... import compat
from ...batch import grad_groups
from ...comm.mesh import Axis, as_mesh, axis_group, is_nd, mesh_dims, submesh, tp_size
from ...errors import Refused


def mesh_ranks(mesh: DeviceMesh) -> list[int]:
    """The global ranks of every position of ``mesh``, sorted (dp x sp, hybrid axes included)."""
    return sorted(int(r) for r in mesh.mesh.flatten().tolist())


def grad_ranks(mesh: DeviceMesh) -> list[int]:
    """The global ranks this rank's gradients are averaged with, sorted: every rank of a ``dp x sp``
    mesh; on an N-D mesh its ``"dp_sp"`` group (this rank's tp index)."""
    if is_nd(mesh):
        return sorted(dist.get_process_group_ranks(axis_group(mesh, Axis.DP_SP.value)))
    return mesh_ranks(mesh)


def dp_sp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """One process group over every rank of ``mesh`` (dp x sp, hybrid axes included).

    The whole world when the mesh spans it (no new group); otherwise a new group, which, like
    ``dist.new_group``, every rank of the world must create together.
    """
    if is_nd(as_mesh(mesh, "dp_sp_group")):
        return axis_group(mesh, Axis.DP_SP.value)
    ranks = mesh_ranks(mesh)
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks)


def dp_sp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A 1-D DeviceMesh named ``"dp_sp"`` over every rank of ``mesh`` (what FSDP2 shards over); on an
    N-D mesh its ``"dp_sp"`` view (the same root as its tp axis)."""
    if is_nd(as_mesh(mesh, "dp_sp_mesh")):
        return submesh(mesh, Axis.DP_SP.value)
    return DeviceMesh.from_group(dp_sp_group(mesh), mesh.device_type, mesh_dim_names=("dp_sp",))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, **fully_shard_kwargs: Any) -> nn.Module:
    """FSDP2 over all dp x sp ranks: ``fully_shard`` each decoder block, then the root, on the
    flattened mesh (:func:`dp_sp_mesh`), with FSDP2's own gradient averaging. Call after
    :func:`seqpar.parallelize`.

    Gradients then equal the non-parallel model's (as DTensors sharded over the ranks). Extra
    keywords go to ``fully_shard`` (``mp_policy``, ``reshard_after_forward``, ...). Raises
    :class:`seqpar.Refused` for a model whose experts are sharded (expert parallelism): FSDP2 would
    take every rank's experts for copies of one tensor.
    """
    from torch.distributed.fsdp import fully_shard

    sharded = grad_groups.sharded_params(model)
    if sharded:
        raise Refused(_sharded_problem("FSDP2 (fully_shard)", sharded))

    flat = fsdp_mesh(mesh)
    blocks = compat.decoder_block_classes(model)
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=flat, **fully_shard_kwargs)
    fully_shard(model, mesh=flat, **fully_shard_kwargs)
    return model


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What :func:`apply_fsdp` shards over: :func:`dp_sp_mesh`, or on an N-D mesh with
    dp_replicate > 1 the 2-D ``("dp_replicate", "dp_shard_sp")`` mesh (HSDP)."""
    if is_nd(mesh) and mesh_dims(mesh).dp_replicate > 1:
        from ... import compat

        flat = submesh(mesh, Axis.DP_SP.value)
        dims = mesh_dims(mesh)
        return compat.unflatten_mesh(flat, (dims.dp_replicate, dims.dp_shard * dims.sp),
                                     ("hsdp_replicate", "hsdp_shard"))
    return dp_sp_mesh(mesh)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, **ddp_kwargs: Any) -> nn.parallel.DistributedDataParallel:
    """Stock DDP over all dp x sp ranks of ``mesh`` (its default averaging). Call after
    :func:`seqpar.parallelize`; returns the DDP wrapper (``ddp(**local)`` works as ``model(**local)``).
    Raises :class:`seqpar.Refused` for a model whose experts are sharded (expert parallelism), before
    DDP's constructor would broadcast rank 0's experts over every rank's own, and on a mesh with
    tp > 1 (DDP does not take DTensor parameters: use :func:`apply_fsdp`, or :func:`seqpar.sync_gradients`)."""
    sharded = grad_groups.sharded_params(model)
    if sharded:
        raise Refused(_sharded_problem("DistributedDataParallel", sharded))
    if tp_size(as_mesh(mesh, "apply_ddp")) > 1:
        raise Refused("DistributedDataParallel does not take tensor-parallel (DTensor) parameters: use "
                      "seqpar.apply_fsdp(model, mesh), or no wrapper and seqpar.sync_gradients(model, mesh)")
    return nn.parallel.DistributedDataParallel(model, process_group=dp_sp_group(mesh), **ddp_kwargs)


def _sharded_problem(what: str, sharded: list[grad_groups.ShardedParams]) -> str:
    """Why ``what`` (a wrapper) cannot hold a model with sharded experts, and what to use instead."""
    return (f"{what} treats every parameter as one tensor copied on every rank of one group, but "
            f"{sharded[0].what} are sharded over expert-parallel ranks (each rank holds different experts): their "
            "gradients must be averaged over the ranks that hold the same experts only -- use no wrapper and "
            "seqpar.sync_gradients(model, mesh), which averages each parameter over the ranks that hold it")


def gradient_reduction_problem(model: nn.Module, mesh: DeviceMesh) -> str | None:
    """Why the data-parallel wrappers around ``model`` would not give it exact gradients, or None.

    Looks at the DDP whose forward is running (if any) and at every FSDP2 module inside ``model``:
    each must average over exactly the ranks of ``mesh``. No communication: the verdict follows
    from how this rank was wrapped, which a symmetric setup makes the same on every rank."""
    from torch.distributed.fsdp import FSDPModule

    want = grad_ranks(mesh)
    reducers: list[tuple[str, list[int]]] = []
    ddp = compat.active_ddp_module()
    if ddp is not None:
        reducers.append(("DistributedDataParallel", sorted(dist.get_process_group_ranks(ddp.process_group))))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            reducers += [(f"FSDP2 (fully_shard) on {type(module).__name__}", mesh_ranks(m))
                         for m in compat.fsdp_meshes(module)]
    sharded = grad_groups.sharded_params(model)
    if reducers and sharded:
        return _sharded_problem(reducers[0][0], sharded)
    for what, got in reducers:
        if got != want:
            return (f"{what} averages the gradients over ranks {got}, but this model is sequence-parallel over "
                    f"the dp x sp ranks {want}: each rank holds only its share of the gradient, so the average "
                    "must span every one of them -- wrap over the whole mesh: DistributedDataParallel over "
                    "all its ranks (seqpar.apply_ddp(model, mesh)), fully_shard over the flattened dp x sp "
                    "mesh (seqpar.apply_fsdp(model, mesh)), or no wrapper and seqpar.sync_gradients(model, mesh)")
    return None


def check_gradient_reduction(model: nn.Module, mesh: DeviceMesh) -> None:
    """Raise :class:`seqpar.Refused` if :func:`gradient_reduction_problem` finds one."""
    problem = gradient_reduction_problem(model, mesh)
    if problem is not None:
        raise Refused(problem)
