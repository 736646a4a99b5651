"""Which token mixers a model has that seqpar cannot make exact (yet): refused at ``parallelize``.

seqpar makes *attention* exact across ranks. A decoder that mixes tokens along the sequence by other
means -- a convolution over time (Mamba, short convolutions, Gated DeltaNet), a linear-attention or
recurrent layer, chunked or indexed (sparse) attention -- would run those on each rank's shard
alone, from a zero state, and give a plausible but wrong loss. Such a model is refused with the
module and the reason instead. Pure: reads the model's config and modules, no communication::

    config.layer_types     "full_attention", "sliding_attention", "chunked_attention": handled
                           (:mod:`.layer_spec`); "mlp", "moe": per token; anything else
                           ("linear_attention", "conv", "hybrid", "indexed_attention", ...): refused
    decoder modules        an nn.Conv1d anywhere in the decoder (over the sequence): refused
    attention_chunk_size   without "chunked_attention" layer types: which layers are chunked is
                           unknown, refused

Positional code that reads the *local* sequence length instead of the position ids seqpar feeds
is refused too (it would be wrong on every rank but the first):

    forward without position_ids  the model numbers tokens by their index in the shard (BART,
                             Whisper, Pegasus, Marian and their relatives)
    position embedding with padding_idx  positions derived from input_ids from padding_idx + 1
                             (RoBERTa and its relatives), not the 0-based ids seqpar feeds
    attn_temperature_tuning  Llama 4 scales queries of its NoPE layers by a function of
                             arange(local length)
"""

from __future__ import annotations

import inspect

from torch import nn

from .models import decoder_config

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
PER_TOKEN_LAYER_TYPES = frozenset({"mlp", "moe"})


def unsupported_mixers(model: nn.Module) -> list[str]:
    """One line per kind of token mixer of ``model`` that seqpar would run on a shard alone; empty
    when every token mixer is self-attention seqpar handles."""
    config = decoder_config(model.config)[0]
    reasons = []
    kinds = {k for k in (getattr(config, "layer_types", None) or ()) if isinstance(k, str)}
    odd = sorted(kinds - ATTENTION_LAYER_TYPES - PER_TOKEN_LAYER_TYPES)
    if odd:
        reasons.append(f"config.layer_types has {odd} layers (seqpar handles {sorted(ATTENTION_LAYER_TYPES)})")
    if getattr(config, "attention_chunk_size", None) and "chunked_attention" not in kinds:
        reasons.append(f"attention_chunk_size={config.attention_chunk_size} (chunked attention) without "
                       "config.layer_types saying which layers are chunked")
    no_rope = getattr(config, "no_rope_layers", None) or []
    if getattr(config, "attn_temperature_tuning", False) and any(not use_rope for use_rope in no_rope):
        reasons.append("attn_temperature_tuning=True: the NoPE layers scale queries by their index in the "
                       "local shard (arange of the local length), not by the global position seqpar feeds; "
                       "a config with attn_temperature_tuning=False is a different model, not a fix")
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    reasons += _positional(model, decoder)
    convs: dict[str, str] = {}  # class of the module that owns the convolution -> its first path
    for name, module in decoder.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, nn.Conv1d):
                convs.setdefault(type(module).__name__, f"{name}.{child_name}" if name else child_name)
    for owner, path in sorted(convs.items()):
        reasons.append(f"{owner} convolves over the sequence ({path}: nn.Conv1d)")
    return reasons


def _positional(model: nn.Module, decoder: nn.Module) -> list[str]:
    """Reasons the model cannot take the global positions seqpar feeds (see the module doc)."""
    reasons = []
    if "position_ids" not in inspect.signature(type(model).forward).parameters:
        reasons.append(f"{type(model).__name__}.forward takes no position_ids: the model numbers tokens by their "
                       "index in each rank's shard, and seqpar cannot feed it their global positions")
    for name, module in decoder.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and "position" in leaf and module.padding_idx is not None:
            reasons.append(f"{name} (nn.Embedding, padding_idx={module.padding_idx}) numbers positions from "
                           "padding_idx + 1 and derives them from input_ids, not from the 0-based position ids "
                           "seqpar feeds")
            break
    return reasons


def check_token_mixers(model: nn.Module) -> None:
    """Raise ValueError naming every token mixer of ``model`` seqpar cannot make exact."""
    reasons = unsupported_mixers(model)
    if reasons:
        raise ValueError(
            f"seqpar cannot parallelize {type(model).__name__} yet: these parts mix tokens along the sequence (or "
            "read their position in it) in a way seqpar does not shard exactly; each rank would run them on its "
            "shard alone and get silently wrong losses and gradients:\n  " + "\n  ".join(reasons)
            + "\n  seqpar supports models whose token mixers are all self-attention (full, sliding-window or "
            "chunked) fed by position ids; for this one train without sequence parallelism (sp=1) for now.")
