"""Bidirectional spans of a vision-language model's attention mask, from its ``token_type_ids``.

Gemma 3 lets the tokens of one image see each other whatever their order, PaliGemma its whole
prefix (image and prompt); transformers builds that as ``blockwise_overlay(block_sequence_ids)``
OR-ed with the causal mask, a dense ``S x S`` mask of the local shard under sequence parallelism.
seqpar takes the whole rows' ``token_type_ids`` from :func:`seqpar.shard_batch` instead, turns
them into span ids by the family's rule (:data:`SPAN_RULES`, the model's own numbering) and puts
them in the batch's SeqShard before the first layer: every strategy and kernel then reads them
as structure (:class:`seqpar.attention.spec.MaskInfo`), and a span may straddle shards. The model
itself gets no ``token_type_ids``: it uses them for this mask only. Pure but for the shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...attention.shard import SeqShard
from ...batch.local_batch import LocalBatch
from ...errors import Refused
from .families import FAMILIES, family_of, family_problem


def image_runs(token_types: Tensor) -> Tensor:
    """Gemma 3's ``get_block_sequence_ids_for_mask``: each run of image tokens (``== 1``) one span,
    numbered from 0 along the row; -1 elsewhere. ``[B, S] -> [B, S]``."""
    image = token_types == 1
    starts = image & ~torch.nn.functional.pad(image, (1, 0), value=False)[:, :-1]
    return torch.where(image, starts.long().cumsum(dim=1) - 1, -1)


def prefix(token_types: Tensor) -> Tensor:
    """PaliGemma's prefix: every ``token_type_ids == 0`` token in span 0, the suffix in none."""
    return torch.where(token_types == 0, 0, -1)


SPAN_RULES: dict[str, Callable[[Tensor], Tensor]] = {"images": image_runs, "prefix": prefix}
"""How a family's token types become span ids (:attr:`~seqpar.integrations.vlm.families.Family.spans`)."""


def with_spans(batch: LocalBatch, span_ids: Tensor, device: torch.device) -> None:
    """Give ``batch``'s shard the bidirectional span ids ``span_ids [B, S]`` of the whole rows
    (original token order, -1 for none), permuted to the layout as the segments are, on ``device``
    (where attention runs). Once per batch, before its first attention layer (the shard's plans
    are made after it). Rows without a span leave the shard as it is: its fast paths stay."""
    if not bool((span_ids >= 0).any()):
        return
    shard = batch.shard
    blocks = span_ids.to(device=device, dtype=torch.int64)
    if shard.positions is not None:
        blocks = blocks.index_select(1, shard.positions.to(device))
    batch.shard = SeqShard(shard.seq_lens, shard.positions, shard.key_keep, shard.segments, shard.state.derived(),
                           blocks)


def spans_problem(model: nn.Module) -> str | None:
    """Why ``model``'s ``token_type_ids`` cannot become seqpar's spans exactly, or None."""
    family = family_of(model)
    if family.spans is None:
        name = getattr(model.config, "model_type", "?")
        refused = family_problem(model) if name in FAMILIES else None  # a family refused by its mechanism: name it
        return refused or (f"{type(model).__name__} (model_type {name!r}) has no bidirectional spans seqpar builds "
                           "from token_type_ids: drop token_type_ids from the batch")
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if family.spans == "prefix" and getattr(text, "sliding_window", None) is not None:
        # create_sliding_window_causal_mask ORs the span after the window: the prefix is seen whole on
        # sliding layers, where seqpar's spans keep the window
        return (f"{type(model).__name__}'s sliding layers see the whole prefix past their window (PaliGemma 2's "
                "sliding mask ORs the prefix span after the window), which seqpar's spans do not express")
    return None


def apply_spans(model: nn.Module, batch: LocalBatch, kwargs: dict[str, Any], device: torch.device) -> None:
    """Before ``model`` runs ``batch``: its token types as the shard's span ids, and the positions
    a one-based family computes itself (+1) where the batch brought none. Raises Refused -- on
    every rank alike, before any collective -- for a model without such spans."""
    if batch.token_types is not None:
        problem = spans_problem(model)
        if problem is not None:
            raise Refused(f"seqpar: token_type_ids given: {problem}")
        with_spans(batch, SPAN_RULES[family_of(model).spans](batch.token_types), device)
    if family_of(model).one_based and not batch.positions_given and kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = kwargs["position_ids"] + 1  # the unsharded model's own arange(S) + 1
