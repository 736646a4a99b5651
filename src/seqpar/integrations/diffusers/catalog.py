"""The diffusers transformers ``seqpar train --objective flow-matching`` builds and calls: the built-in
tiny ones (no download: a config written here) and the classes whose training call it knows.

A class is trainable when its forward is ``model(hidden_states=x_t [B, C, F, H, W], timestep=[B],
encoder_hidden_states=text [B, L, D])`` -- video latents, per-sample timesteps on the model's scale,
text embeddings every rank holds whole -- and seqpar parallelizes it exactly (:mod:`.families`)::

    class                          timestep scale   latents        text
    WanTransformer3DModel          1000 t           [C, F, H, W]   [L, text_dim]

Any other class (an image model, a model with pooled or extra conditioning, a Wan variant whose
training call is not tested here) is a ValueError naming it: its call is not the one the training job
makes. A class joins with an entry in :data:`TRAINABLE` and a test of its step at sp=2 against sp=1.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Trainable:
    """How the training job calls one class: its timestep scale (the model takes ``scale * t``,
    t in (0, 1)) and the config fields that give the latents' channels, the patch and the text width."""

    timestep_scale: float = 1000.0
    channels: str = "in_channels"
    patch: str = "patch_size"
    text: str = "text_dim"


TRAINABLE: dict[str, Trainable] = {
    "WanTransformer3DModel": Trainable(),
}

TINY_WAN: dict[str, Any] = dict(patch_size=(1, 4, 4), num_attention_heads=4, attention_head_dim=24, in_channels=3,
                                out_channels=3, text_dim=16, freq_dim=32, ffn_dim=192, num_layers=2,
                                cross_attn_norm=True, rope_max_seq_len=32)
"""``tiny-wan``: a Wan 2.1 transformer at a size a CPU trains in minutes (4 heads x 24, 2 blocks, 1 x 4 x 4
patches); its latents are RGB frames (3 channels), its text 16 wide."""

BUILTIN_DITS: dict[str, tuple[str, dict[str, Any]]] = {"tiny-wan": ("WanTransformer3DModel", TINY_WAN)}
"""Built-in DiT names -> (diffusers class, config)."""

CONFIG_FILE = "config.json"


def dit_class(name: str) -> type:
    """The diffusers class ``name`` (a model class diffusers exports). ValueError otherwise."""
    import diffusers

    cls = getattr(diffusers, name, None)
    if not isinstance(cls, type) or not issubclass(cls, diffusers.ModelMixin):
        raise ValueError(f"{name!r} is not a diffusers model class")
    return cls


def dit_config(name_or_dir: str, **overrides: Any) -> tuple[str, dict[str, Any]]:
    """``(class name, config)`` of a built-in DiT (:data:`BUILTIN_DITS`, ``overrides`` applied) or of a
    diffusers ``save_pretrained`` directory (its ``config.json``: ``_class_name`` and the fields).
    ValueError for anything else, or a class the training job cannot call (:data:`TRAINABLE`)."""
    if name_or_dir in BUILTIN_DITS:
        cls, config = BUILTIN_DITS[name_or_dir]
        config = {**config, **overrides}
    else:
        path = os.path.join(name_or_dir, CONFIG_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"--model {name_or_dir!r} is neither a built-in DiT ({', '.join(BUILTIN_DITS)}) nor a "
                             f"diffusers save_pretrained directory (no {CONFIG_FILE})")
        if overrides:
            raise ValueError("--model-config applies to built-in models only; a checkpoint brings its own config")
        with open(path) as f:
            config = json.load(f)
        cls = config.get("_class_name")
        if not isinstance(cls, str):
            raise ValueError(f"--model {name_or_dir!r}: {path} names no diffusers class (_class_name): not a "
                             "diffusers model directory")
    if cls not in TRAINABLE:
        raise ValueError(f"--model {name_or_dir!r} is a {cls}; seqpar train --objective flow-matching calls "
                         f"{' or '.join(TRAINABLE)} (video latents [C, F, H, W], text embeddings [L, D])")
    return cls, {k: v for k, v in config.items() if not k.startswith("_")}


def build_dit(name_or_dir: str, *, dtype: torch.dtype = torch.float32, weights: bool = True,
              **overrides: Any) -> nn.Module:
    """The DiT ``name_or_dir`` names (see :func:`dit_config`): a built-in with fresh weights (seed torch
    first: the same on every rank), or a directory's weights (``from_pretrained``; ``weights=False``:
    its config alone, fresh weights), in ``dtype``, train mode."""
    cls_name, config = dit_config(name_or_dir, **overrides)
    cls = dit_class(cls_name)
    if name_or_dir in BUILTIN_DITS or not weights:
        model = cls(**config)
    else:
        model = cls.from_pretrained(name_or_dir)
    return cast(model, dtype).train()


def cast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` in ``dtype``, every module (diffusers' advice to keep some norms in float32 silenced: the
    run's --dtype is what is wanted, and a float64 run is float64 throughout)."""
    if next(model.parameters()).dtype == dtype:  # diffusers warns on any .to(dtype), even a no-op one
        return model
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        return model.to(dtype)
    finally:
        diffusers_logging.set_verbosity(verbosity)


def trainable_of(model: nn.Module) -> Trainable:
    """How the training job calls ``model`` (:data:`TRAINABLE`). ValueError for another class."""
    name = type(model).__name__
    if name not in TRAINABLE:
        raise ValueError(f"{name}: the flow-matching job calls {' or '.join(TRAINABLE)}")
    return TRAINABLE[name]


class ConfigWriter:
    """What a checkpoint writes beside the weights for a DiT: its diffusers ``config.json`` (with
    ``_class_name``), through the same ``save_pretrained(dir)`` a transformers config has."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def save_pretrained(self, directory: str) -> None:
        self.model.save_config(directory)
