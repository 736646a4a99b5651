"""Checkpoints of a model under expert parallelism (``seqpar train --ep``): each rank's expert shards,
and their AdamW states, presented to torch.distributed.checkpoint as what they are -- rows of one
stacked tensor -- so that DCP writes every shard once and reads any layout back.

Under EP a rank's ``model.state_dict()`` holds its own shard ``[E/ep, ...]`` under the whole tensor's
name: DCP would take the shards of the ep ranks for copies of one tensor and keep one of them. Here,
before a save and a load, every stacked expert parameter and its optimizer states become DTensors on
the expert-parallel mesh (:func:`seqpar.comm.mesh.ep_mesh`)::

    shard     # [E/ep, ...]  this rank's experts (tensor_split: rank r owns rows start_r .. start_r + n_r)
    DTensor   # [E, ...]     on ("ep_dp", "ep"): Replicate over the ranks holding the same experts,
                             Shard(0) over the ep ranks

so DCP records the global shape and each shard's offset, writes each shard from one of its replicas,
and loads into any layout: another ep, no EP (the whole tensor), another dp or sp. After a load the
DTensors are unwrapped back to the shards (same storage) for ``set_state_dict``.

DTensor's ``Shard(0)`` places rank r at ``torch.chunk``'s offset (``ceil(E / ep)`` rows per rank, the last
ones fewer or none) while seqpar's experts follow ``torch.tensor_split`` (the first ``E % ep`` ranks one
more): the two agree when ep divides E and in some uneven cases (5 over 2: 3 + 2 both); where they do
not (7 over 3: 3 3 1 vs 3 2 2) :func:`checkpoint_split_problem` says so and ``seqpar train`` refuses
the --ep before any worker starts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from seqpar.comm.collectives import split_sizes


def checkpoint_split_problem(num_experts: int, ep: int) -> str | None:
    """Why ``num_experts`` experts over ``ep`` ranks cannot be saved as one DTensor (pure), or None:
    seqpar's split (``torch.tensor_split``) must equal DTensor's ``Shard(0)`` (``torch.chunk``)."""
    ours = split_sizes(num_experts, ep)
    chunk = -(-num_experts // ep)
    theirs = [max(0, min(chunk, num_experts - r * chunk)) for r in range(ep)]
    if ours == theirs:
        return None
    fits = [d for d in range(2, num_experts + 1) if num_experts % d == 0]
    return (f"{num_experts} experts over {ep} ranks are split {ours} (torch.tensor_split, as seqpar's expert "
            f"parallelism), but a torch.distributed.checkpoint DTensor shards them {theirs} (torch.chunk), so the "
            f"checkpoints could not record them; choose --ep dividing {num_experts} (e.g. {fits[:4]})")


def expert_params(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """``{state-dict name: (first expert, experts here, all experts)}`` of every stacked expert
    parameter of ``model`` under EP ({} without)."""
    from seqpar.integrations.moe.expert_parallel import expert_parallel_modules
    from seqpar.integrations.moe.plan import expert_range

    out = {}
    for path, _module, forward in expert_parallel_modules(model):
        start, n = expert_range(forward.num_experts, forward.layout.size, forward.layout.rank)
        for name in forward.params:
            out[f"{path}.{name}" if path else name] = (start, n, forward.num_experts)
    return out


def _as_dtensor(local: Tensor, mesh: DeviceMesh, experts: int) -> Tensor:
    """This rank's rows of a stacked tensor as the whole ``[experts, ...]`` DTensor (no copy)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = torch.Size((experts, *local.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False, shape=shape, stride=stride)


def present(model: nn.Module, mesh: DeviceMesh, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> list[str]:
    """Replace, in place, the expert shards of ``model_sd`` and their tensors in ``optim_sd``
    (:func:`torch.distributed.checkpoint.state_dict.get_state_dict`'s, keyed by the same names) by
    DTensors of the whole stacked tensors (module doc). Returns the names replaced ([] without EP)."""
    from seqpar.comm.mesh import ep_mesh

    found = expert_params(model)
    if not found:
        return []
    where = ep_mesh(mesh)
    for name, (start, n, experts) in found.items():
        problem = checkpoint_split_problem(experts, where.size(1))
        assert problem is None, problem  # refused with the option by prepare_job
        assert model_sd[name].shape[0] == n, (name, tuple(model_sd[name].shape), n)
        assert where.get_local_rank(1) * -(-experts // where.size(1)) == start, (name, start)  # DTensor's offset
        model_sd[name] = _as_dtensor(model_sd[name], where, experts)
        states = optim_sd.get("state", {})
        if name in states:  # a new dict: the optimizer's own per-parameter state stays as it is
            states[name] = {key: _as_dtensor(value, where, experts)  # exp_avg, exp_avg_sq; not step
                            if isinstance(value, Tensor) and value.dim() and value.shape[0] == n else value
                            for key, value in states[name].items()}
    return list(found)


def unwrap(names: list[str], model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    """Undo :func:`present` after a load: each DTensor back to this rank's shard (the tensor DCP read into)."""
    for name in names:
        model_sd[name] = model_sd[name].to_local()
        states = optim_sd.get("state", {})
        if name in states:
            states[name] = {key: value.to_local() if hasattr(value, "to_local") else value
                            for key, value in states[name].items()}
