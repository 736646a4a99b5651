"""Where an objective's reference log-probabilities come from: a frozen copy of the model, the same
model with its LoRA adapters disabled, or a precomputed input (``ref_logps``: per sequence ``[N]``, or
per token ``[B, S]`` aligned with the labels). The first two run the reference on this rank's shard,
without gradient, through the same tiled head as the policy."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from ..integrations.memory.tiled_head import output_head
from ..integrations.peft import is_peft_model, unwrap_peft
from ..integrations.state import state_of
from .tokens import final_hidden, local_targets, token_logps_entropy

ADAPTERS_OFF = "adapters_off"
"""``reference=ADAPTERS_OFF``: the policy itself with its peft adapters disabled (``disable_adapter()``)."""

Reference = nn.Module | str | None
"""A frozen copy of the model (parallelized over the same mesh), :data:`ADAPTERS_OFF`, or None (the
reference log-probabilities come as the ``ref_logps`` input, or the objective needs none)."""


def check_reference(reference: Reference, model: nn.Module) -> None:
    """ValueError for a reference seqpar cannot run next to ``model`` (the same on every rank)."""
    if reference is None:
        return
    if isinstance(reference, str):
        if reference != ADAPTERS_OFF:
            raise ValueError(f"reference={reference!r}: use a frozen copy of the model, "
                             f"reference={ADAPTERS_OFF!r} (a peft model with its adapters off) or a ref_logps input")
        if not is_peft_model(model):
            raise ValueError(f"reference={ADAPTERS_OFF!r} needs a peft model (its adapters are what is turned off); "
                             f"{type(model).__name__} has none: pass a frozen copy as reference=")
        return
    if not isinstance(reference, nn.Module):
        raise ValueError(f"reference must be a model, {ADAPTERS_OFF!r} or None, got {type(reference).__name__}")
    if reference is model:
        raise ValueError("reference is the policy model itself: pass a frozen copy (copy.deepcopy before "
                         f"training) or reference={ADAPTERS_OFF!r}")
    state = state_of(reference)
    if state is None or state.parallel is None:
        raise ValueError("the reference model is not parallelized: seqpar.parallelize(reference, mesh) with the "
                         "policy's mesh (or deep-copy the parallelized policy)")


def reference_token_logps(reference: Reference, model: nn.Module, local: dict[str, Any], *, temperature: float,
                          tile: int) -> Tensor:
    """The reference's ``log p(target)`` ``[B, S_local]`` on this rank's shard, without gradient."""
    runner = model if isinstance(reference, str) else reference
    off = runner.disable_adapter() if isinstance(reference, str) else contextlib.nullcontext()
    with torch.no_grad(), off:
        hidden, _ = final_hidden(runner, local)
        logp, _ = token_logps_entropy(hidden, output_head(unwrap_peft(runner)), local_targets(local),
                                      temperature=temperature, tile=tile)
    return logp
