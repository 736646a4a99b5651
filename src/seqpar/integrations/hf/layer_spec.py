"""What one transformers attention layer computes, read from the call, the module and the config.

transformers builds most of a layer's mask outside the attention function (``masking_utils``), from
the config: a sliding window, a chunk, per ``config.layer_types[layer_idx]``. seqpar suppresses those
masks (they describe the local shard), so it must read the same facts itself, or the window would
silently disappear. Where each comes from, first match wins::

    window   call keyword sliding_window    (Mistral, Gemma 2, Qwen 2 pass it)
             config.layer_types[i]          "sliding_attention" -> config.sliding_window
                                            (Qwen2-MoE with use_sliding_window)
             config.sliding_window          a model without layer_types whose modeling file builds
                                            sliding-window masks masks every layer with it (PhiMoE,
                                            Doge); one whose file does not (Moshi) never uses it
    chunk    config.layer_types[i]          "chunked_attention" -> config.attention_chunk_size (Llama 4)
    sinks    call keyword s_aux             GPT-OSS and its ports: [H] logits, a parameter
             module.sinks
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn


@dataclass(frozen=True)
class LayerOptions:
    """The spec options of one attention call besides scale, causal, softcap and dropout."""

    window: int | None = None
    chunk: int | None = None
    sinks: Tensor | None = None


def _positive(x: Any) -> int | None:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None


def layer_type(module: nn.Module, config: Any) -> str | None:
    """``config.layer_types[module.layer_idx]``, or None when the model has no per-layer types."""
    types, idx = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if isinstance(types, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(types):
        return str(types[idx])
    return None


def builds_sliding_masks(module: nn.Module) -> bool:
    """Whether the module's modeling file uses transformers' sliding-window mask builder."""
    return hasattr(inspect.getmodule(type(module)), "create_sliding_window_causal_mask")


def layer_options(module: nn.Module, config: Any, kwargs: dict[str, Any]) -> LayerOptions:
    """The window, chunk and sinks of this call (see the module doc)."""
    kind = layer_type(module, config)
    window = _positive(kwargs.get("sliding_window"))
    if window is None and kind is not None:
        window = _positive(getattr(config, "sliding_window", None)) if kind == "sliding_attention" else None
    elif window is None and builds_sliding_masks(module):
        window = _positive(getattr(config, "sliding_window", None))
    chunk = _positive(getattr(config, "attention_chunk_size", None)) if kind == "chunked_attention" else None
    sinks = kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), Tensor):
        sinks = module.sinks
    return LayerOptions(window=window, chunk=chunk, sinks=sinks)
