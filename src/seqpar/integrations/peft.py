"""peft models (LoRA and the other adapters) under seqpar: the transformers model inside a ``PeftModel``.

peft injects its adapter layers into the transformers model it wraps, in place: the model's own
attention still goes through ``AttentionInterface``, its loss through ``loss_function``, and the
adapters are per-token linear maps, exact on any sequence shard. So a ``PeftModel`` is
parallelized by parallelizing ``peft_model.get_base_model()`` -- the same object the PeftModel's
forward runs -- and nothing else changes. peft is optional: without it nothing is a PeftModel.
"""

from __future__ import annotations

import sys

from torch import nn


def is_peft_model(model: nn.Module) -> bool:
    """True for a peft ``PeftModel`` (looked up only if peft is already imported: a model cannot be
    one otherwise, and seqpar never imports peft for nothing)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft ``PeftModel`` (its adapters injected in it); any other
    module as is."""
    return model.get_base_model() if is_peft_model(model) else model
