"""Targets of a causal-LM batch, before any sharding: pure functions, no communication.

The target of position i is ``labels[i + 1]``. It is ignored (``ignore_index``) at the last
position, where position i or i + 1 is padding, and where i + 1 starts a new packed document
(predicting the first token of the next document from the previous one is noise). A new document
starts wherever ``position_ids`` does not grow by exactly 1 (e.g. restarts at 0), as in
transformers' own packed-sequence detection. Shifting *before* sharding is what keeps the target
of a shard's last token, which lives on the next rank::

    labels     a  b  c | d  e  f        (| = shard boundary)
    targets    b  c  d | e  f  -        rank 0 keeps "d" as the target of "c"

**A padding position predicts nothing**, so in a left-padded row the first real token is no
position's target (its label is left out, as if the row had no padding)::

    attention  0  0  1  1  1
    labels     -  -  a  b  c
    targets    -  -  b  c  -            "a" is left out: position 1 is padding

transformers' own causal-LM loss keeps that label with ``sdpa`` (the padding position attends to
nothing, yet its logits predict "a") and gets NaN with ``eager``. Every seqpar objective follows
this rule (their per-token quantities are counted where the target is kept);
:func:`targets_after_padding` counts the labels it leaves out, and :func:`seqpar.shard_batch` says
so once (:class:`seqpar.errors.TargetsLeftOut`). docs/guides/training-loop.md: "Which positions
have a target".
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


CU_SEQLENS_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The flash-attention packing keys of transformers' ``DataCollatorWithFlattening``: document
offsets in the flattened ``[B * S]`` batch. seqpar checks them against the rows and the position
ids, derives position ids from them when there are none, and does not pass them on (they describe
the unsharded batch)."""


def cu_seqlens_problem(batch: Mapping[str, Any], b: int, s: int) -> str | None:
    """What is wrong with a batch's ``cu_seq_lens_q`` / ``cu_seq_lens_k``, or None (also when it has
    none): they must be equal, start at 0, grow strictly, end at ``B * S``, start a document at every
    row, and -- with ``position_ids`` -- start documents exactly where the positions restart."""
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None or not torch.equal(cu_q.reshape(-1).cpu(), cu_k.reshape(-1).cpu()):
        return "cu_seq_lens_q and cu_seq_lens_k must both be given and equal (self-attention over packed documents)"
    cu = cu_q.reshape(-1).to("cpu", torch.long)
    if cu.numel() < 2 or int(cu[0]) != 0 or not bool((cu[1:] > cu[:-1]).all()):
        return f"cu_seq_lens_q must start at 0 and grow strictly (document offsets), got {cu.tolist()[:8]}..."
    if int(cu[-1]) != b * s:
        return (f"cu_seq_lens_q ends at {int(cu[-1])} but the batch holds {b} x {s} = {b * s} tokens: documents "
                "longer than the rows, or offsets of another batch")
    starts = set(cu[:-1].tolist())
    if not {r * s for r in range(b)} <= starts:
        return "a document in cu_seq_lens_q crosses a row boundary: every row must start a document"
    pos = batch.get("position_ids")
    if pos is not None:
        restarts = segments_from_positions(pos.to("cpu", torch.long).expand(b, s)).diff(dim=-1, prepend=torch.full(
            (b, 1), -1)) != 0  # [B, S] True where a document starts
        if set(restarts.reshape(-1).nonzero().flatten().tolist()) != starts:
            return ("cu_seq_lens_q contradicts position_ids: their documents start at different tokens (pass one "
                    "of them, or both from the same collator)")
    return None


def positions_from_cu_seqlens(cu_seqlens: Tensor, b: int, s: int) -> Tensor:
    """``[B, S]`` position ids restarting at 0 at every document offset of ``cu_seqlens``."""
    cu = cu_seqlens.reshape(-1).to(torch.long)
    flat = torch.arange(b * s, device=cu.device)
    doc = torch.searchsorted(cu, flat, right=True) - 1
    return (flat - cu[doc]).view(b, s)


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
    if pos is None and batch.get("cu_seq_lens_q") is not None:  # checked by cu_seqlens_problem
        pos = positions_from_cu_seqlens(batch["cu_seq_lens_q"].to(ref.device), b, s)
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


def targets_after_padding(labels: Tensor, key_keep: Tensor | None, ignore_index: int = IGNORE_INDEX) -> int:
    """Labels that a padding position would predict -- the first real token of a left-padded row --
    which transformers' sdpa loss counts and the rule of the module docstring leaves out. ``labels``,
    ``key_keep`` (False on padding, None: none): ``[B, S]``, unshifted."""
    if key_keep is None or labels.shape[1] < 2:
        return 0
    after_pad = ~key_keep[:, :-1] & key_keep[:, 1:] & (labels[:, 1:] != ignore_index)  # [B, S - 1]
    return int(after_pad.sum())
