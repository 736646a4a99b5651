"""Which token mixers a model has that seqpar cannot make exact (yet): refused at ``parallelize``.

seqpar makes attention exact across ranks, and the state-space, linear-attention and short-
convolution mixers of :data:`.registry.HANDLED_MIXERS` (Mamba, Mamba2, Gated DeltaNet, Kimi, LFM2;
the families of this package). A decoder that mixes tokens along the sequence by any other means -- an
unknown convolution over time or recurrent layer, lightning or indexed (sparse) attention -- would
run it on each rank's shard alone, from a zero state, and give a plausible but wrong loss. Such a
model is refused with the module and the reason instead. Pure: reads the model's config and
modules, no communication::

    config.layer_types     "full_attention", "sliding_attention", "chunked_attention": handled
                           (:mod:`~seqpar.integrations.hf.layer_spec`); "mlp", "moe": per token; any other kind
                           ("linear_attention", "conv", "mamba", "hybrid", "indexed_attention", ...):
                           handled only where that decoder layer holds a handled token mixer
    decoder modules        an nn.Conv1d or recurrent nn.RNN / nn.LSTM / nn.GRU outside a handled
                           token mixer (over the sequence): refused
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

from ...errors import Refused
from ..models import decoder_config
from .registry import HANDLED_MIXERS, family_of

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
PER_TOKEN_LAYER_TYPES = frozenset({"mlp", "moe"})


def unsupported_mixers(model: nn.Module) -> list[str]:
    """One line per kind of token mixer of ``model`` that seqpar would run on a shard alone; empty
    when every token mixer is self-attention seqpar handles."""
    config = decoder_config(model.config)[0]
    reasons = []
    kinds = {k for k in (getattr(config, "layer_types", None) or ()) if isinstance(k, str)}
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    odd = _unhandled_layer_types(config, decoder, kinds - ATTENTION_LAYER_TYPES - PER_TOKEN_LAYER_TYPES)
    if odd:
        reasons.append(f"config.layer_types has {sorted(odd)} layers (seqpar handles {sorted(ATTENTION_LAYER_TYPES)}"
                       f" and layers whose token mixer is one of {sorted(HANDLED_MIXERS)}); "
                       + "; ".join(f"{k!r}: {v}" for k, v in sorted(odd.items())))
    if getattr(config, "attention_chunk_size", None) and "chunked_attention" not in kinds:
        reasons.append(f"attention_chunk_size={config.attention_chunk_size} (chunked attention) without "
                       "config.layer_types saying which layers are chunked")
    no_rope = getattr(config, "no_rope_layers", None) or []
    if getattr(config, "attn_temperature_tuning", False) and any(not use_rope for use_rope in no_rope):
        reasons.append("attn_temperature_tuning=True: the NoPE layers scale queries by their index in the "
                       "local shard (arange of the local length), not by the global position seqpar feeds; "
                       "a config with attn_temperature_tuning=False is a different model, not a fix")
    reasons += _positional(model, decoder)
    convs: dict[str, str] = {}  # class of the module that owns the convolution -> its first path
    handled = [name for name, m in decoder.named_modules() if family_of(m) is not None]
    for name, module in decoder.named_modules():
        if any(name == h or name.startswith(h + ".") for h in handled):
            continue  # inside a token mixer seqpar handles (its own convolution)
        for child_name, child in module.named_children():
            if isinstance(child, (nn.Conv1d, nn.RNNBase)):
                path = f"{name}.{child_name}" if name else child_name
                convs.setdefault(type(module).__name__, f"{path}: nn.{type(child).__name__}")
    for owner, path in sorted(convs.items()):
        verb = "runs a recurrence" if "nn.Conv1d" not in path else "convolves"
        reasons.append(f"{owner} {verb} over the sequence ({path}), which is not a token mixer seqpar handles")
    return reasons


def _unhandled_layer_types(config: object, decoder: nn.Module, odd: set[str]) -> dict[str, str]:
    """The non-attention layer kinds of ``config.layer_types`` whose layers do not all hold a
    handled token mixer, each with what the first such layer holds instead."""
    if not odd:
        return {}
    types = list(getattr(config, "layer_types", None) or ())
    layers = next((m for m in decoder.modules() if isinstance(m, nn.ModuleList) and len(m) == len(types)), None)
    if layers is None:
        return {k: "seqpar cannot find the decoder layers these types describe" for k in odd}
    out: dict[str, str] = {}
    for i, (kind, layer) in enumerate(zip(types, layers, strict=True)):
        if kind in odd and kind not in out and not any(family_of(m) for m in layer.modules()):
            names = sorted({type(c).__name__ for c in layer.children()})
            out[kind] = f"layer {i} ({type(layer).__name__}: {', '.join(names)}) has no token mixer seqpar handles"
    return out


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
    """Raise :class:`~seqpar.errors.Refused` naming every token mixer of ``model`` seqpar cannot
    make exact."""
    reasons = unsupported_mixers(model)
    if reasons:
        raise Refused(
            f"seqpar cannot parallelize {type(model).__name__} yet: these parts mix tokens along the sequence (or "
            "read their position in it) in a way seqpar does not shard exactly; each rank would run them on its "
            "shard alone and get silently wrong losses and gradients:\n  " + "\n  ".join(reasons)
            + "\n  seqpar supports models whose token mixers are all self-attention (full, sliding-window or "
            "chunked) fed by position ids, or the state-space / linear-attention / short-convolution mixers of "
            "seqpar.integrations.mixers.HANDLED_MIXERS; for this one train without sequence parallelism "
            "(sp=1) for now.")
