"""M-RoPE positions of a batch with images, computed the way the model computes them, before sharding.

Qwen-VL-style models (M-RoPE: a ``[3, B, S]`` temporal / height / width position per token) get
them from their public ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, ...)``,
which reads the *whole* row: text after an image continues past the image's largest extent, so
no shard can compute its own. Every SP rank holds the whole batch (the VisualBatch), calls the
model's rope index once, and keeps its slice::

    one document per row   rope_index(input_ids [B, S], ..., attention_mask)      (what the model does)
    packed rows            each document becomes a row of its own, right-padded:
                           rope_index(docs [D, L], ..., attention_mask [D, L]) -> scattered back
                           to [3, B, S]: every document gets the positions the model computes for it
                           alone (its images' grids are consumed in the same row-major order)

For packed rows transformers has no M-RoPE of its own (its rope index reads whole rows, and 1-D
``position_ids`` put every image patch at a text position), so the reference is the documents
unpacked, each its own row. Padding tokens get position 0 (no target reads them, no key is kept).
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from ...batch.visual import VisualBatch

ROPE_KEYS = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
"""The visual keys a model's get_rope_index may read (beside input_ids and attention_mask)."""


def documents(segments: Tensor, keep: Tensor | None) -> list[tuple[int, Tensor]]:
    """``(row, token indices)`` of every document of packed rows, row-major, padding left out.
    ``segments [B, S]``: document ids (:func:`seqpar.batch.targets.segments_from_positions`);
    ``keep [B, S]``: the attention mask (None: no padding). Pure."""
    out = []
    for b in range(segments.shape[0]):
        for d in torch.unique_consecutive(segments[b]).tolist():
            idx = (segments[b] == d).nonzero().flatten()
            if keep is not None:
                idx = idx[keep[b, idx].bool()]
            if idx.numel():
                out.append((b, idx))
    return out


def _per_document(rope_index, visual: VisualBatch, kw: dict[str, Tensor], mask_param: bool) -> Tensor:
    """``[3, B, S]``: the rope index on each document of packed rows as a row of its own."""
    ids = visual.input_ids
    docs = documents(visual.segments.to(ids.device), visual.attention_mask)
    width = max(int(idx.numel()) for _, idx in docs)
    rows = ids.new_zeros(len(docs), width)  # [D, L], right-padded
    mask = ids.new_zeros(len(docs), width)
    types = kw.get("mm_token_type_ids")
    doc_types = None if types is None else types.new_zeros(len(docs), width)
    for i, (b, idx) in enumerate(docs):
        rows[i, :idx.numel()], mask[i, :idx.numel()] = ids[b, idx], 1
        if doc_types is not None:
            doc_types[i, :idx.numel()] = types[b, idx]
    if doc_types is not None:
        kw = {**kw, "mm_token_type_ids": doc_types}
    if mask_param:
        kw["attention_mask"] = mask
    pos, _ = rope_index(rows, **kw)  # [3, D, L]
    out = pos.new_zeros(3, *ids.shape)
    for i, (b, idx) in enumerate(docs):
        out[:, b, idx.to(out.device)] = pos[:, i, :idx.numel()]
    return out


def mrope_positions(model: nn.Module, visual: VisualBatch, me: int, device: torch.device) -> Tensor | None:
    """This rank's slice ``[3, B, S_local]`` of the M-RoPE positions of the whole batch (see the
    module doc), or None when the model would compute none (no rope index, no grid, or 1-D
    position ids given to rows of one document each: the model then uses those). Raises
    ValueError, the same on every rank, when the grids come without ``mm_token_type_ids``."""
    rope_index = getattr(model.base_model, "get_rope_index", None)
    t = visual.tensors
    if rope_index is None or not ({"image_grid_thw", "video_grid_thw"} & set(t)):
        return None
    if visual.positions_given and visual.segments is None:
        return None
    params = inspect.signature(rope_index).parameters
    if "mm_token_type_ids" in params and "mm_token_type_ids" not in t:
        raise ValueError("seqpar: image_grid_thw / video_grid_thw were given without mm_token_type_ids, which this "
                         "model's M-RoPE positions need: pass the processor's mm_token_type_ids to shard_batch")
    kw = {k: t[k] for k in ROPE_KEYS if k in t and k in params}
    with torch.no_grad():
        if visual.segments is not None:
            pos = _per_document(rope_index, visual, kw, "attention_mask" in params)
        else:
            if "attention_mask" in params and visual.attention_mask is not None:
                kw["attention_mask"] = visual.attention_mask
            pos, _ = rope_index(visual.input_ids, **kw)  # [3, B, S], the whole rows
    return pos.index_select(-1, visual.pieces[me].to(pos.device)).to(device)
