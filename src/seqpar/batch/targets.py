"""Targets of a causal-LM batch, before any sharding: pure functions, no communication.

The target of position i is ``labels[i + 1]``. It is ignored (``ignore_index``) at the last
position, where position i or i + 1 is padding, and where i + 1 starts a new packed document
(predicting the first token of the next document from the previous one is noise). A new document
starts wherever ``position_ids`` does not grow by exactly 1 (e.g. restarts at 0), as in
transformers' own packed-sequence detection. Shifting *before* sharding is what keeps the target
of a shard's last token, which lives on the next rank::

    labels     a  b  c | d  e  f        (| = shard boundary)
    targets    b  c  d | e  f  -        rank 0 keeps "d" as the target of "c"
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Prepared:
    """Batch-level facts in the original token order (pure function of the full batch)."""

    position_ids: Tensor  # [B, S] long
    key_keep: Tensor | None  # [B, S] bool, None: no padding
    segments: Tensor | None  # [B, S] long, None: one document per row
    targets: Tensor | None  # [B, S] long, shifted, IGNORE where no target
    weights: Tensor | None  # [B, S] float, shifted with the targets


def segments_from_positions(position_ids: Tensor) -> Tensor:
    """``[B, S]`` document id of each token: a new document wherever the position does not grow by
    exactly 1 (a restart at 0 in a packed row)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def shift_targets(labels: Tensor, *, key_keep: Tensor | None = None, segments: Tensor | None = None,
                  weights: Tensor | None = None, ignore_index: int = IGNORE_INDEX
                  ) -> tuple[Tensor, Tensor | None]:
    """The target of each position (``labels[:, i + 1]``) with the rules of the module docstring.

    ``labels``, ``key_keep``, ``segments``, ``weights``: ``[B, S]``. Returns ``(targets [B, S],
    shifted weights [B, S] or None)``; weights are 0 where the target is ignored.
    """
    targets = torch.full_like(labels, ignore_index)
    targets[:, :-1] = labels[:, 1:]
    keep = torch.ones_like(labels, dtype=torch.bool)
    keep[:, -1] = False
    if key_keep is not None:
        keep[:, :-1] &= key_keep[:, :-1] & key_keep[:, 1:]
    if segments is not None:
        keep[:, :-1] &= segments[:, :-1] == segments[:, 1:]
    targets = targets.masked_fill(~keep, ignore_index)
    shifted_w = None
    if weights is not None:
        shifted_w = torch.zeros_like(weights)
        shifted_w[:, :-1] = weights[:, 1:]
        shifted_w = shifted_w.masked_fill(targets == ignore_index, 0)
    return targets, shifted_w


def prepare_batch(batch: Mapping[str, Any], ignore_index: int = IGNORE_INDEX) -> Prepared:
    """Position ids (``arange`` if absent, as transformers does), key mask, segments and shifted
    targets of a full ``[B, S]`` batch. Pure: no communication."""
    ids = batch.get("input_ids")
    ref = ids if ids is not None else batch["inputs_embeds"][..., 0]
    b, s = ref.shape[:2]
    pos = batch.get("position_ids")
    pos = torch.arange(s, device=ref.device).expand(b, s) if pos is None else pos.to(torch.long).expand(b, s)
    mask = batch.get("attention_mask")
    key_keep = None
    if mask is not None and not bool(mask.bool().all()):
        key_keep = mask.bool()
    segments = segments_from_positions(pos) if s else None
    if segments is not None and bool((segments[:, -1] == 0).all()):
        segments = None  # one document per row: no segment mask needed
    targets = weights = None
    if batch.get("labels") is not None:
        w = batch.get("loss_weights")
        targets, weights = shift_targets(batch["labels"].to(torch.long), key_keep=key_keep, segments=segments,
                                         weights=None if w is None else w.to(torch.float64),
                                         ignore_index=ignore_index)
    return Prepared(pos.contiguous(), key_keep, segments, targets, weights)


def target_count(prep: Prepared, ignore_index: int = IGNORE_INDEX) -> float:
    """Targets of a prepared batch (the sum of their weights when loss weights are given)."""
    if prep.targets is None:
        return 0.0
    if prep.weights is not None:
        return float(prep.weights.sum())
    return float((prep.targets != ignore_index).sum())
