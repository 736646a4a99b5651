"""A diffusers ``save_pretrained`` directory out of a trained (parallelized or plain) DiT: what
``seqpar train --objective flow-matching --export-hf`` and ``seqpar export`` write, and what
``DiffusersClass.from_pretrained(dir)`` loads::

    state      the model's whole state dict (every rank holds it: a DiT trains without FSDP2)
    fresh      type(model).from_config(model.config), with the same LoRA adapters (diffusers'
               add_adapter), given the state
    LoRA       fuse_lora() then unload_lora(): W + (alpha / r) B A in every adapted layer, a plain model
    write      save_pretrained(dir): config.json (_class_name) + diffusion_pytorch_model.safetensors

The trained model itself is never touched: a fresh copy is written.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from .catalog import cast


def lora_config_of(model: nn.Module) -> Any | None:
    """The peft ``LoraConfig`` of a DiT's adapters (diffusers' ``add_adapter``), or None."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    if len(configs) != 1:
        raise ValueError(f"the model holds {len(configs)} adapters ({', '.join(configs)}): export writes one")
    return next(iter(configs.values()))


def write_dit_pretrained(model: nn.Module, state: dict[str, Tensor], save_directory: str, *,
                         lora: Any | None = None, dtype: torch.dtype | None = None) -> str:
    """Write ``state`` (a whole state dict of a DiT of ``model``'s class and config; with ``lora``, a
    peft ``LoraConfig``: of the model with those adapters) as diffusers ``save_pretrained`` output,
    the adapters merged into the weights. ``dtype``: cast the floating tensors (default: as trained).
    One process. Returns the directory."""
    with warnings.catch_warnings():  # diffusers warns about config keys it does not expect
        warnings.simplefilter("ignore")
        fresh = type(model).from_config(dict(model.config))
    if lora is not None:
        fresh.add_adapter(copy.deepcopy(lora))
    fresh = cast(fresh, next(iter(state.values())).dtype)
    fresh.load_state_dict(state, strict=True)
    if lora is not None:
        fresh.fuse_lora()  # W + scale * B A, in every adapted layer
        fresh.unload_lora()  # the adapter layers out: plain Linear modules holding the merged weights
    if dtype is not None:
        fresh = cast(fresh, dtype)
    os.makedirs(save_directory, exist_ok=True)
    fresh.save_pretrained(save_directory)
    return save_directory


def save_dit_pretrained(model: nn.Module, save_directory: str, *, rank: int = 0,
                        dtype: torch.dtype | None = None) -> str | None:
    """Write a trained DiT (parallelized or not: its weights are whole on every rank) as
    ``save_pretrained`` output (:func:`write_dit_pretrained`); only ``rank`` 0 writes. Returns the
    directory on rank 0, None elsewhere. No collective."""
    if rank != 0:
        return None
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return write_dit_pretrained(model, state, save_directory, lora=lora_config_of(model), dtype=dtype)
