"""The visual side of a batch: what a vision-language model's processor returns beside the text.

:func:`seqpar.shard_batch` shards the text (``input_ids`` with its image / video placeholder
tokens, labels, masks) and does not cut the visual tensors: they describe whole images, and
which rank encodes which image is the model's business (:mod:`seqpar.integrations.vlm.encoder`). It checks
them (shapes that hold for every model, the same on every SP rank) and hands them, with the whole
row's ``input_ids`` and this rank's token indices, to the model in a :class:`VisualBatch`::

    full batch    input_ids [B, S] (placeholders), pixel_values, image_grid_thw, mm_token_type_ids, ...
      shard_batch   text sharded as before; visual keys checked, kept whole
    local batch   input_ids [B, S_local], ..., seqpar_batch = LocalBatch(..., visual=VisualBatch)

Keys seqpar routes are :data:`ROUTED_KEYS`; keys of a mechanism seqpar does not run yet are
refused by name (:data:`REFUSED_KEYS`, raised as :class:`~seqpar.errors.Refused`), never dropped.
Pure functions, no communication.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

ROUTED_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "image_sizes",
               "spatial_shapes", "pixel_attention_mask", "mm_token_type_ids", "second_per_grid_ts")
"""Processor outputs :func:`seqpar.shard_batch` takes: pixels (patch rows with a grid, one entry
per image, or images batched per row ``[B, images, C, H, W]``), the grids, sizes and pixel masks
that say which rows are which image (``spatial_shapes`` / ``pixel_attention_mask [images,
patches]`` of SigLIP-2 towers, ``pixel_attention_mask [B, images, H, W]`` beside per-row pixels),
the modality of every token (``mm_token_type_ids [B, S]``: 0 text, 1 image, 2 video), and
Qwen2.5-VL's video timing."""

SPAN_KEYS = ("token_type_ids",)
"""Token types a model turns into bidirectional spans of its attention mask (Gemma 3: each run of
image tokens; PaliGemma: the prefix): :func:`seqpar.shard_batch` keeps them whole (the spans are
the whole row's, so one may straddle shards), and the model's family says how they become span
ids (:mod:`seqpar.integrations.vlm.spans`)."""

REFUSED_KEYS: dict[str, str] = {
    "pixel_mask": "a pixel mask per image (Aria)",
    "image_patches": "Fuyu's raw image patches",
    "image_patches_indices": "Fuyu's raw image patches",
    "pixel_values_images": "Video-LLaVA's separate image pixels",
    "pixel_values_local": "local crops beside the global view (DeepSeek-OCR, Step3)",
    "num_local_patches": "local crops beside the global view (DeepSeek-OCR, Step3)",
    "high_res_pixel_values": "a second, high-resolution image tower (DeepSeek-VL hybrid)",
    "image_position_ids": "per-image position ids of the vision tower (Gemma 4)",
    "video_position_ids": "per-video position ids of the vision tower (Gemma 4)",
    "aspect_ratio_ids": "cross-attention to image tiles (Mllama)",
    "aspect_ratio_mask": "cross-attention to image tiles (Mllama)",
    "cross_attention_mask": "cross-attention to image tiles (Mllama)",
    "input_features": "audio inputs",
    "input_features_mask": "audio inputs",
    "feature_attention_mask": "audio inputs",
    "input_values": "audio inputs",
    "mm_encoder_outputs": "pre-encoded image features (seqpar encodes the images itself, divided over the SP ranks)",
}
"""Multimodal keys seqpar does not route yet, and the mechanism each one stands for."""

_GRIDS = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}


class VisualBatch:
    """The whole batch's visual inputs, as every SP rank holds them (checked equal by shard_batch).

    tensors         the :data:`ROUTED_KEYS` present, whole (pixels of every image of every row)
    input_ids       ``[B, S]`` the whole rows: where each placeholder token is
    attention_mask  ``[B, S]`` the processor's padding mask or None (the model's rope index reads it)
    positions_given whether the batch brought its own position_ids (then the model computes none)
    pieces          ``pieces[r]``: the indices of the row's tokens rank r holds, in its local order
    segments        ``[B, S]`` document ids of packed rows (position ids restarting), or None (one
                    document per row): an M-RoPE model's positions are then computed per document

    A plain class, like :class:`~seqpar.batch.local_batch.LocalBatch`, so that DDP / FSDP input movers
    leave it alone: the model moves what it encodes to its own device.
    """

    __slots__ = ("tensors", "input_ids", "attention_mask", "positions_given", "pieces", "segments")

    def __init__(self, tensors: dict[str, Tensor], input_ids: Tensor, attention_mask: Tensor | None,
                 positions_given: bool, pieces: Sequence[Tensor], segments: Tensor | None = None) -> None:
        self.tensors, self.input_ids, self.attention_mask = tensors, input_ids, attention_mask
        self.positions_given, self.pieces, self.segments = positions_given, tuple(pieces), segments

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={list(v.shape)}" for k, v in self.tensors.items())
        return f"VisualBatch({shapes})"


def refused_key_problem(batch: Mapping[str, Any]) -> str | None:
    """Why seqpar refuses a multimodal key of ``batch``, or None: the key and its mechanism."""
    for key, why in REFUSED_KEYS.items():
        if batch.get(key) is not None:
            return f"seqpar does not run {key!r} under sequence parallelism: {why}"
    return None


def visual_problem(batch: Mapping[str, Any], b: int, s: int) -> str | None:
    """What is wrong with the visual keys of a ``[b, s]`` batch, in ways that hold for every model
    (the model checks its own layout when it encodes), or None."""
    for key in SPAN_KEYS:
        t = batch.get(key)
        if t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != (b, s) or t.is_floating_point()):
            return f"{key} must be an integer tensor [batch, seq_len] = [{b}, {s}] like input_ids"
    present = {k: batch[k] for k in ROUTED_KEYS if batch.get(k) is not None}
    if not present:
        return None
    if not all(isinstance(t, Tensor) for t in present.values()):
        return f"the visual inputs must be tensors (the processor's return_tensors='pt'): {sorted(present)}"
    if batch.get("input_ids") is None:
        return ("images need input_ids: seqpar finds each image's placeholder tokens there (inputs_embeds "
                "carry none)")
    tt = present.get("mm_token_type_ids")
    if tt is not None and tuple(tt.shape) != (b, s):
        return f"mm_token_type_ids must be [batch, seq_len] = [{b}, {s}] like input_ids, got {list(tt.shape)}"
    for pixels, grid_key in _GRIDS.items():
        grid = present.get(grid_key)
        if grid is None:
            continue
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point() or bool((grid <= 0).any()):
            return f"{grid_key} must be [n, 3] positive integers (t, h, w per image or video)"
        pv = present.get(pixels)
        if pv is None:
            return f"{grid_key} is given without {pixels}"
        rows = int(grid.prod(-1).sum())
        if pv.dim() < 2 or pv.shape[0] != rows:
            return (f"{pixels} must be [patches, ...] with one row per patch of {grid_key} ({rows} rows), "
                    f"got {list(pv.shape)}")
    mask, pv = present.get("pixel_attention_mask"), present.get("pixel_values")
    if mask is not None:
        per_row = pv is not None and pv.dim() == 5 and mask.dim() == 4
        if pv is None or (tuple(mask.shape) != (*pv.shape[:2], *pv.shape[-2:]) if per_row
                          else mask.shape[0] != pv.shape[0]):
            return ("pixel_attention_mask must match pixel_values: [B, images, H, W] beside per-row pixels "
                    "[B, images, C, H, W], or one entry per image beside pixel_values [images, ...]")
    shapes = present.get("spatial_shapes")
    if shapes is not None and (pv is None or shapes.dim() != 2 or shapes.shape != (pv.shape[0], 2)):
        return "spatial_shapes must be [images, 2] (patch rows and columns), beside pixel_values [images, ...]"
    sizes = present.get("image_sizes")
    if sizes is not None:
        pv = present.get("pixel_values")
        if sizes.dim() != 2 or sizes.shape[1] != 2 or pv is None or "image_grid_thw" in present:
            return "image_sizes must be [images, 2] (height, width), beside pixel_values with one entry per image"
        if pv.shape[0] != sizes.shape[0]:
            return f"image_sizes has {sizes.shape[0]} images but pixel_values {pv.shape[0]}"
    return None


def fingerprint(tensors: Mapping[str, Tensor]) -> float:
    """A cheap float64 fingerprint of a dict of tensors, equal on ranks that hold equal tensors
    (same values in the same order): tells whether the SP ranks got the same images."""
    if not tensors:
        return -1.0
    total = 0.0
    for i, (key, t) in enumerate(sorted(tensors.items())):
        flat = t.detach().reshape(-1).to(torch.float64)
        w = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 65521 + 1 + i
        total += float((flat * w).sum()) + len(key)
    return total


def visual_batch(batch: Mapping[str, Any], pieces: Sequence[Tensor], positions_given: bool,
                 segments: Tensor | None = None) -> VisualBatch | None:
    """The :class:`VisualBatch` of a checked batch (None: it has no visual inputs); ``segments``:
    its packed rows' document ids (:func:`seqpar.batch.targets.segments_from_positions`) or None."""
    tensors = {k: batch[k] for k in ROUTED_KEYS if batch.get(k) is not None}
    if not tensors:
        return None
    return VisualBatch(tensors, batch["input_ids"], batch.get("attention_mask"), positions_given, pieces, segments)
