"""LoRA in ``seqpar train`` (``--lora-r``): peft adapters on the model, the base weights frozen.

peft injects the adapters into the transformers model in place (``get_peft_model``), so the model
``seqpar train`` parallelizes, shards and runs is the same object with adapter layers inside; the
``PeftModel`` around it is kept to export the adapters. The adapters' initial values are drawn
here, not by peft: A from a generator seeded by ``(--seed, the parameter's index)`` with peft's own
rule (Kaiming-uniform, a = sqrt(5)), B zeros -- so they are the same bits on any number of ranks,
sharded or not, and a base checkpoint's tensors load under their LoRA names (``base_layer``).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .config import TrainConfig


def lora_alpha(cfg: TrainConfig) -> float:
    return float(cfg.lora_alpha) if cfg.lora_alpha is not None else 2.0 * cfg.lora_r


def default_targets(cfg: TrainConfig) -> str | tuple[str, ...]:
    """The modules --lora-r adapts unless --lora-targets: the objective's kind of data says
    (all-linear for a transformers model, a DiT's attention projections)."""
    from .objectives import DATA_KINDS, objective_of

    return DATA_KINDS[objective_of(cfg.objective).data].lora_targets


def _targets(cfg: TrainConfig) -> Any:
    default = default_targets(cfg)
    return cfg.lora_targets or (list(default) if isinstance(default, tuple) else default)


def lora_config(cfg: TrainConfig, task_type: str | None = "CAUSAL_LM") -> Any:
    """peft's LoraConfig for the run: no dropout (the step stays exact and deterministic), no bias."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=lora_alpha(cfg), target_modules=_targets(cfg), lora_dropout=0.0,
                      bias="none", task_type=task_type)


def add_dit_lora(model: nn.Module, cfg: TrainConfig) -> None:
    """Adapters into a diffusers DiT in place (diffusers' ``add_adapter``: the base frozen, the model
    stays a ``ModelMixin``). ValueError when --lora-targets names no module of the model."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.add_adapter(lora_config(cfg, task_type=None))
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"--lora-targets {' '.join(_words(cfg))}: {e}") from None


def _words(cfg: TrainConfig) -> list[str]:
    targets = _targets(cfg)
    return [targets] if isinstance(targets, str) else list(targets)


def add_lora(model: nn.Module, cfg: TrainConfig) -> Any:
    """Adapters into ``model`` (in place: the base weights frozen); returns the ``PeftModel`` around it.
    ValueError when --lora-targets names no module of the model."""
    from peft import get_peft_model

    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            peft = get_peft_model(model, lora_config(cfg))
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"--lora-targets {' '.join(_words(cfg))}: {e}") from None
    # the base an exported adapter names: the --model checkpoint (None for a built-in: the export
    # then writes the base beside the adapter)
    peft.peft_config[peft.active_adapter].base_model_name_or_path = (
        os.path.abspath(cfg.model) if os.path.isdir(cfg.model) else None)
    return peft


def describe_lora(cfg: TrainConfig) -> str:
    return f"LoRA r={cfg.lora_r}, alpha={lora_alpha(cfg):g} on {' '.join(_words(cfg))}" if cfg.lora_r else ""


def lora_init(model: nn.Module, seed: int) -> dict[str, Tensor]:
    """The initial value of every adapter parameter of ``model`` (full tensors on the CPU, in the
    parameter's dtype), keyed by name: peft's init rules, drawn from per-parameter generators."""
    out: dict[str, Tensor] = {}
    named = sorted((n, p) for n, p in model.named_parameters() if ".lora_" in n)
    for i, (name, p) in enumerate(named):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        t = torch.zeros(tuple(p.shape), dtype=torch.float32)
        if ".lora_A." in name:
            nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
        elif ".lora_embedding_B" in name:
            nn.init.normal_(t, generator=g)
        out[name] = t.to(p.dtype)  # lora_B, lora_embedding_A: zeros (the adapters start as the identity)
    return out


def init_lora(model: nn.Module, seed: int) -> None:
    """Give ``model``'s adapters their initial values (:func:`lora_init`), sharded or not: every rank
    holds the full tensors and keeps its part."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, lora_init(model, seed), options=StateDictOptions(full_state_dict=True, strict=False))


def with_lora_names(model: nn.Module, base_state: Mapping[str, Tensor], seed: int) -> dict[str, Tensor]:
    """A base checkpoint's state dict under ``model``'s names once the adapters are in (an adapted
    layer's weight moves to ``<layer>.base_layer.weight``), plus the adapters' initial values."""
    adapters = lora_init(model, seed)
    out: dict[str, Tensor] = {}
    for name in model.state_dict():
        out[name] = adapters[name] if name in adapters else base_state[name.replace(".base_layer.", ".")]
    return out


def count_params(model: nn.Module) -> tuple[int, int]:
    """``(all parameters, trainable ones)``."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
