"""Which token mixers a model has that seqpar cannot make exact (yet): refused at ``parallelize``.

seqpar makes *attention* exact across ranks. A decoder that mixes tokens along the sequence by other
means -- a convolution over time (Mamba, short convolutions, Gated DeltaNet), a linear-attention or
recurrent layer, chunked or indexed (sparse) attention -- would run those on each rank's shard
alone, from a zero state, and give a plausible but wrong loss. Such a model is refused with the
module and the reason instead. Pure: reads the model's config and modules, no communication::

    config.layer_types     "full_attention", "sliding_attention": handled; "mlp", "moe": per token;
                           anything else ("linear_attention", "conv", "hybrid", "chunked_attention",
                           "indexed_attention", ...): refused
    decoder modules        an nn.Conv1d anywhere in the decoder (over the sequence): refused
    attention_chunk_size   chunked attention (Llama 4): refused
"""

from __future__ import annotations

from torch import nn

from .models import decoder_config

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
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
        reasons.append(f"attention_chunk_size={config.attention_chunk_size} (chunked attention)")
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    convs: dict[str, str] = {}  # class of the module that owns the convolution -> its first path
    for name, module in decoder.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, nn.Conv1d):
                convs.setdefault(type(module).__name__, f"{name}.{child_name}" if name else child_name)
    for owner, path in sorted(convs.items()):
        reasons.append(f"{owner} convolves over the sequence ({path}: nn.Conv1d)")
    return reasons


def check_token_mixers(model: nn.Module) -> None:
    """Raise ValueError naming every token mixer of ``model`` seqpar cannot make exact."""
    reasons = unsupported_mixers(model)
    if reasons:
        raise ValueError(
            f"seqpar cannot parallelize {type(model).__name__} yet: besides attention it mixes tokens along the "
            "sequence in layers seqpar does not shard exactly, which would run on each rank's shard alone and "
            "give silently wrong losses and gradients:\n  " + "\n  ".join(reasons)
            + "\n  Only models whose token mixers are all self-attention are supported today.")
