"""A transformers checkpoint out of a parallelized, FSDP2-sharded (or plain) model: :func:`save_pretrained`.

A model's own ``save_pretrained`` cannot run under FSDP2 (its parameters are DTensor shards:
"Attempted to access the data pointer on an invalid python storage"), and would describe one rank's
shard at best. Here every rank takes part in one gather -- torch's
``get_model_state_dict(full_state_dict=True, cpu_offload=True)``, which leaves the whole state dict
on rank 0 only, in CPU memory -- and rank 0 writes it through a fresh copy of the model built on
the meta device and given those tensors (no second copy of the weights)::

    every rank     get_model_state_dict(model, full_state_dict, cpu_offload)   (collective)
    rank 0         type(model)(config) on meta  <- load_state_dict(assign=True)
                   [LoRA: merge_and_unload, or the adapter alone]
                   save_pretrained(dir)  (safetensors, config.json)  + tokenizer.save_pretrained(dir)

The parallelized model itself is never touched: training can go on after a save.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...comm.mesh import is_nd
from ..moe.expert_parallel import gather_experts
from ..peft import is_peft_model, unwrap_peft

LORA_EXPORTS = ("merged", "adapter")
BASE_DIR = "base"  # lora="adapter" for a base model that has no directory of its own


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole state dict of ``model`` (sharded or not, its experts under expert parallelism
    gathered whole) on rank 0, on the CPU; ``{}`` on the other ranks. A collective when a process
    group exists (every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not (dist.is_available() and dist.is_initialized()):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    experts = gather_experts(model)  # expert parallelism: each rank holds a shard under the whole tensor's name
    for name, whole in experts.items():
        if name in state:
            state[name] = whole.cpu()
    return state


def _fresh_copy(model: nn.Module, state: dict[str, Tensor]) -> nn.Module:
    """A new, unparallelized model of the same class (and the same adapters, for a PeftModel)
    holding ``state``'s tensors: built on the meta device, then given them (``assign``)."""
    inner = unwrap_peft(model)
    with torch.device("meta"):
        clean: nn.Module = type(inner)(copy.deepcopy(inner.config))
        if is_peft_model(model):
            from peft import get_peft_model

            config = model.peft_config[model.active_adapter]
            fresh = copy.deepcopy(config)
            fresh.base_model_name_or_path = None  # get_peft_model names it after the copy (and warns otherwise)
            clean = get_peft_model(clean, fresh)
            clean.peft_config[clean.active_adapter].base_model_name_or_path = config.base_model_name_or_path
    clean.load_state_dict(state, strict=True, assign=True)
    return clean


def write_pretrained(model: nn.Module, state: dict[str, Tensor], save_directory: str, *, tokenizer: Any = None,
                     lora: str = "merged", dtype: torch.dtype | None = None) -> str:
    """Write ``state`` (a full state dict of ``model``, e.g. from :func:`full_state_dict` or a
    checkpoint) as ``save_pretrained`` output in ``save_directory``, in one process. ``model``
    only lends its class, config and adapter config. ``lora="adapter"`` writes peft's adapter files;
    when the adapter config names no base model (one built from a config), the base model is
    written too, in ``save_directory/base``, and named. Returns the directory."""
    if lora not in LORA_EXPORTS:
        raise ValueError(f"lora={lora!r}: choose one of {list(LORA_EXPORTS)}")
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    clean = _fresh_copy(model, state)
    os.makedirs(save_directory, exist_ok=True)
    if is_peft_model(clean) and lora == "merged":
        clean = clean.merge_and_unload()  # W + (alpha / r) B A in every adapted layer: a plain transformers model
    base = None
    if is_peft_model(clean) and not clean.peft_config[clean.active_adapter].base_model_name_or_path:
        # an adapter needs its base model; one built from a config names none, so it goes along
        base = os.path.join(save_directory, BASE_DIR)
        clean.peft_config[clean.active_adapter].base_model_name_or_path = os.path.abspath(base)
    clean.save_pretrained(save_directory)  # a PeftModel writes its adapter files only
    if base is not None:
        clean.unload().save_pretrained(base)  # the base weights: adapters taken out, not merged
    if tokenizer is not None:
        tokenizer.save_pretrained(save_directory)
    return save_directory


def save_pretrained(model: nn.Module, save_directory: str, mesh: DeviceMesh | None = None, *, tokenizer: Any = None,
                    lora: str = "merged", dtype: torch.dtype | None = None) -> str | None:
    """Save a (parallelized, FSDP2-sharded or plain) transformers or peft model as
    ``save_pretrained`` output that ``AutoModelForCausalLM.from_pretrained`` loads: safetensors,
    config.json (and ``tokenizer``'s files when given).

    Every rank of ``mesh`` (the mesh the model was parallelized and sharded over; None: the whole
    default group, or a single process) must call it: the full state dict is gathered to rank 0
    (CPU), which alone writes. A peft ``PeftModel`` is written with its adapters merged into the
    weights (``lora="merged"``: a plain transformers model) or as peft's adapter files alone
    (``lora="adapter"``). ``dtype``: cast the floating tensors (default: as trained). Tensor-parallel
    (DTensor) weights are gathered whole like FSDP2's (every rank of an N-D mesh calls it). Returns
    the directory on rank 0, None on the others. The model is not changed.
    """
    if lora not in LORA_EXPORTS:  # before the gather: the same error on every rank
        raise ValueError(f"lora={lora!r}: choose one of {list(LORA_EXPORTS)}")
    distributed = dist.is_available() and dist.is_initialized()
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be the DeviceMesh the model was parallelized over, got {type(mesh).__name__}")
    state = full_state_dict(model)
    out = None
    if not distributed or dist.get_rank() == 0:
        out = write_pretrained(model, state, save_directory, tokenizer=tokenizer, lora=lora, dtype=dtype)
    if distributed:
        group = None
        if mesh is not None and not is_nd(mesh):  # an N-D mesh spans the world: the default group
            from ..distributed.fsdp import dp_sp_group

            group = dp_sp_group(mesh)
        dist.barrier(group=group)  # every rank returns once the files are there
    return out
