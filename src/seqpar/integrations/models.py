"""Models to run seqpar on: tiny built-in configs (no download) or a local transformers checkpoint.

The built-in configs are small enough for CPU tests (hidden 32, 2 layers) and each exercises one
attention feature: ``tiny-llama`` (GQA), ``tiny-qwen3`` (q/k norm), ``tiny-mistral`` (sliding
window shorter than the test sequences), ``tiny-gemma2`` (attention-logit softcap, alternating
sliding / full layers, final-logit softcap; eager attention, as transformers needs for softcap).
``tiny-qwen3-moe`` is a Qwen3-MoE (4 experts, top 2, every layer sparse; eager experts, no router
logits output) for expert parallelism. ``small-llama3`` has a realistic shape for memory work (Llama 3
proportions: vocabulary 32x the hidden size, MLP 3.5x, GQA 4:1; hidden 256, 4 layers, 8,192-token
vocabulary, about 6.5M parameters).

:func:`decoder_config` is the one place that finds the decoder's config inside a model's config
(``config`` itself, or ``config.text_config`` for a multimodal model).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import Refused

BUILTIN_MODELS = ["tiny-llama", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "small-llama3"]
# hybrids (issue 13): a Gated DeltaNet layer then an attention layer (Qwen3-Next, dense MLPs), and a
# Mamba2 layer then an attention layer (Bamba)
BUILTIN_MODELS += ["tiny-qwen3-next", "tiny-bamba"]
# an MoE (issue 46): Qwen3-MoE, every layer's MLP 4 experts of which each token takes 2
BUILTIN_MODELS += ["tiny-qwen3-moe"]
_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                            mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False)

_COMMON: dict[str, Any] = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               max_position_embeddings=1024, attention_dropout=0.0, tie_word_embeddings=False)

# Llama 3's proportions at a size a CPU trains: vocabulary / hidden = 32 (Llama-3-8B: 128,256 / 4,096),
# MLP 3.5x, 4 query heads per KV head, RoPE theta 500,000, untied head.
_SMALL_LLAMA3: dict[str, Any] = dict(vocab_size=8192, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
                                     num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                     max_position_embeddings=131072, rope_theta=500000.0, attention_dropout=0.0,
                                     tie_word_embeddings=False)


def builtin_config(name: str, **overrides: Any) -> Any:
    """The transformers config of a built-in tiny model, with ``overrides`` applied."""
    import transformers as tf

    if name == "tiny-llama":
        return tf.LlamaConfig(**{**_COMMON, **overrides})
    if name == "tiny-qwen3":
        return tf.Qwen3Config(**{**_COMMON, **overrides})
    if name == "tiny-mistral":
        return tf.MistralConfig(**{**_COMMON, "sliding_window": 5, **overrides})
    if name == "tiny-gemma2":
        return tf.Gemma2Config(**{**_COMMON, "sliding_window": 5, "attn_logit_softcapping": 2.0,
                                  "final_logit_softcapping": 5.0, "query_pre_attn_scalar": 8, **overrides})
    if name == "small-llama3":
        return tf.LlamaConfig(**{**_SMALL_LLAMA3, **overrides})
    if name in ("tiny-qwen3-next", "tiny-bamba"):
        return _hybrid_config(name, **overrides)
    if name == "tiny-qwen3-moe":
        return tf.Qwen3MoeConfig(**{**_COMMON, **_MOE, **overrides})
    raise ValueError(f"unknown built-in model {name!r}: choose one of {BUILTIN_MODELS} or a local checkpoint path")


def _hybrid_config(name: str, **overrides: Any) -> Any:
    """The built-in hybrids: one linear-attention or Mamba2 layer, then one attention layer."""
    import transformers as tf

    hidden = int(overrides.get("hidden_size", _COMMON["hidden_size"]))
    layers = int(overrides.get("num_hidden_layers", _COMMON["num_hidden_layers"]))
    if name == "tiny-qwen3-next":  # linear, full, linear, ... for any num_hidden_layers
        kinds = ["full_attention" if i % 2 else "linear_attention" for i in range(layers)]
        return tf.Qwen3NextConfig(**{**_COMMON, "layer_types": kinds,
                                     "mlp_only_layers": list(range(layers)), "linear_conv_kernel_dim": 4,
                                     "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                     "linear_key_head_dim": 8, "linear_value_head_dim": 8, **overrides})
    # Mamba2 wants mamba_n_heads * mamba_d_head == mamba_expand * hidden_size
    return tf.BambaConfig(**{**_COMMON, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": hidden // 4,
                             "mamba_expand": 1, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
                             "mamba_chunk_size": 16, **overrides})


def _default_attention(name: str) -> str:
    return "eager" if name == "tiny-gemma2" else "sdpa"  # transformers' sdpa refuses softcap


def check_model_name(name_or_path: str) -> None:
    """Raise ValueError unless ``name_or_path`` is a built-in name or an existing directory."""
    if name_or_path not in BUILTIN_MODELS and not os.path.isdir(name_or_path):
        raise ValueError(f"model {name_or_path!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}) nor a "
                         "local checkpoint directory")


def build_model(name_or_path: str, *, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None,
                **config_overrides: Any) -> tuple[nn.Module, Any]:
    """``(model, tokenizer or None)`` from a built-in name (:data:`BUILTIN_MODELS`) or a local
    checkpoint directory (``from_pretrained``, with its tokenizer if it has one).

    ``attn_implementation``: transformers' name; default ``"sdpa"`` for the built-ins (``"eager"``
    for tiny-gemma2), transformers' own choice for a checkpoint (sdpa where the model supports it).
    In float64, MoE experts run transformers' eager loop (its grouped matmul has no float64).
    ``config_overrides``: config fields, e.g. ``num_attention_heads=6``. Weights of built-in
    models are randomly initialized (seed torch first for reproducible ones). Raises ValueError
    for an unknown name or a missing path.
    """
    from transformers import AutoModelForCausalLM

    if name_or_path in BUILTIN_MODELS:
        impl = attn_implementation or _default_attention(name_or_path)
        config = builtin_config(name_or_path, **config_overrides)
        # an MoE's experts as a loop over its experts (any dtype; the grouped matmul has no float64)
        moe = {"experts_implementation": "eager"} if name_or_path == "tiny-qwen3-moe" else {}
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, **moe)
        return model.to(dtype), None
    check_model_name(name_or_path)
    extra: dict[str, Any] = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    if attn_implementation is not None:
        extra["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **extra, **config_overrides)
    return model, load_tokenizer(name_or_path)


def load_tokenizer(path: str) -> Any:
    """The tokenizer saved in the checkpoint directory ``path``, or None if it has none."""
    if not any(os.path.exists(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def decoder_config(config: Any) -> tuple[Any, str | None]:
    """``(the config that holds the decoder's attention heads, its attribute name or None)``:
    ``config`` itself, or ``config.text_config`` of a multimodal model. ``config`` is a transformers
    config or its ``config.json`` as a dict. Raises ValueError when neither has ``num_attention_heads``."""
    def get(c: Any, key: str) -> Any:
        if isinstance(c, Mapping):
            return c.get(key)
        try:
            return getattr(c, key, None)
        except Exception as e:  # e.g. a per-layer head count transformers refuses to read as one number
            raise Refused(f"{type(c).__name__}.{key} is not one number ({type(e).__name__}): seqpar needs the "
                          "same attention head count in every layer") from None

    if get(config, "num_attention_heads"):
        return config, None
    text = get(config, "text_config")
    if text is not None and get(text, "num_attention_heads"):
        return text, "text_config"
    raise Refused(f"{type(config).__name__} has no num_attention_heads (nor text_config.num_attention_heads):"
                  " seqpar needs a transformers model with self-attention")


def is_diffusers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a diffusers ``ModelMixin`` (False when diffusers is not imported: a model of
    it could not exist then), read without importing diffusers."""
    mixin = getattr(sys.modules.get("diffusers"), "ModelMixin", None)
    return mixin is not None and isinstance(model, mixin)
