"""Vision work divided over the SP group: units, their owners, and where each feature row goes.

Pure functions (no communication, no model): every SP rank holds the same whole batch, so every
rank derives the same plan. :mod:`~seqpar.integrations.vlm.encoder` runs it::

    units       the batch's images, one unit each; a video one unit per frame where the model's
                tower encodes frames apart (Qwen2-VL's convention: attention inside each frame);
                per-row pixels ([B, images, ...], Idefics) one unit per real (not all-zero) image
    assign      contiguous runs of units, balanced by pixel count: rank r encodes units[runs[r]]
    route_plan  feature row j of a modality fills the j-th placeholder token of the whole batch
                (row-major over [B, S], as the model's masked_scatter does); the rank whose shard
                holds that token receives it, in its own row-major order

Feature rows on a rank are its image rows, then its video rows; ranks own contiguous ranges of
each modality's rows (units are images first, then videos, and runs are contiguous).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

MODALITIES = ("image", "video")
PIXELS = {"image": "pixel_values", "video": "pixel_values_videos"}
GRIDS = {"image": "image_grid_thw", "video": "video_grid_thw"}
PER_ITEM = {"image": ("image_sizes", "spatial_shapes", "pixel_attention_mask"), "video": ()}
"""Keys with one entry (dim 0) per image or video, cut with it (per-row layouts: two dims, row
and image)."""


@dataclass(frozen=True)
class Unit:
    """One piece of vision work: an image, a video, or one frame of a video. ``inputs``: the
    encoder's keyword arguments for this piece alone (dim-0 slices, a frame's grid ``[[1, h, w]]``);
    ``cost``: its pixel elements, what the balance counts."""

    modality: str
    inputs: dict[str, Tensor]
    cost: int


def _per_row_units(tensors: Mapping[str, Tensor]) -> list[Unit]:
    """``pixel_values [B, N, C, H, W]`` (and ``pixel_attention_mask [B, N, H, W]``): one unit per
    real image, row-major -- the model drops the all-zero images that pad the rows, and its
    feature rows follow the real images in this order."""
    pixels = tensors["pixel_values"]
    mask = tensors.get("pixel_attention_mask")
    real = pixels.flatten(2).ne(0).any(-1)  # [B, N]: what the model keeps
    out = []
    for b, i in real.nonzero().tolist():
        inputs = {"pixel_values": pixels[b, i][None, None]}  # [1, 1, C, H, W]: a row of one image
        if mask is not None:
            inputs["pixel_attention_mask"] = mask[b, i][None, None]
        out.append(Unit("image", inputs, int(pixels[b, i].numel())))
    return out


def units(tensors: Mapping[str, Tensor], frames_apart: bool, per_row: bool = False) -> list[Unit]:
    """Every unit of the batch, images first then videos, each in the model's order.

    With a grid (``image_grid_thw``), ``pixel_values`` holds ``t * h * w`` patch rows per image;
    without one, one dim-0 entry per image. ``frames_apart``: cut grid videos into their ``t``
    frames (exact only for towers whose attention stays inside a frame). ``per_row``: images
    batched per row (:func:`_per_row_units`)."""
    out: list[Unit] = []
    for modality in MODALITIES:
        pixels = tensors.get(PIXELS[modality])
        if pixels is None:
            continue
        if per_row and modality == "image":
            out += _per_row_units(tensors)
            continue
        grid = tensors.get(GRIDS[modality])
        if grid is None:
            for i in range(pixels.shape[0]):
                inputs = {PIXELS[modality]: pixels[i:i + 1]}
                inputs.update({k: tensors[k][i:i + 1] for k in PER_ITEM[modality] if k in tensors})
                out.append(Unit(modality, inputs, int(pixels[i].numel())))
            continue
        row = 0
        for t, h, w in grid.tolist():
            pieces = [(row + f * h * w, [1, h, w]) for f in range(t)] if frames_apart else [(row, [t, h, w])]
            for start, thw in pieces:
                n = thw[0] * thw[1] * thw[2]
                inputs = {PIXELS[modality]: pixels[start:start + n],
                          GRIDS[modality]: torch.tensor([thw], dtype=grid.dtype, device=grid.device)}
                out.append(Unit(modality, inputs, int(pixels[start:start + n].numel())))
            row += t * h * w
    return out


def assign(costs: Sequence[int], p: int) -> list[range]:
    """Contiguous runs of units for ``p`` ranks, balanced by cost: a unit goes to the rank whose
    equal share of the total holds the unit's midpoint (so no rank is more than about one unit
    above the mean). Contiguous keeps each rank's feature rows one range per modality."""
    total = float(sum(costs))
    owners, before = [], 0.0
    for c in costs:
        mid = before + c / 2.0
        owners.append(min(p - 1, int(mid * p / total)) if total > 0 else 0)
        before += c
    return [range(owners.index(r), len(owners) - owners[::-1].index(r)) if r in owners else range(0)
            for r in range(p)]


def merge_inputs(share: Sequence[Unit]) -> dict[str, dict[str, Tensor]]:
    """One encoder call per modality for a rank's units: their inputs concatenated along dim 0."""
    out: dict[str, dict[str, Tensor]] = {}
    for modality in MODALITIES:
        mine = [u.inputs for u in share if u.modality == modality]
        if mine:
            out[modality] = {k: torch.cat([m[k] for m in mine]) for k in mine[0]}
    return out


@dataclass(frozen=True)
class RoutePlan:
    """This rank's part of the exchange (see :func:`seqpar.comm.route.route_rows`):
    ``send_index[d]`` rows of the local features for rank d; ``recv_counts[s]`` rows from rank s;
    ``order``: the received rows' permutation into this rank's placeholder order (images, then
    videos), None when they arrive in it; ``counts``: this rank's placeholders per modality."""

    send_index: list[Tensor]
    recv_counts: list[int]
    order: Tensor | None
    counts: dict[str, int]


def _owners(pieces: Sequence[Tensor], s: int) -> tuple[Tensor, Tensor]:
    """``(rank [S], local index [S])`` of every position of the row under the layout ``pieces``."""
    rank, local = torch.empty(s, dtype=torch.long), torch.empty(s, dtype=torch.long)
    for r, idx in enumerate(pieces):
        idx = idx.cpu()
        rank[idx] = r
        local[idx] = torch.arange(idx.numel())
    return rank, local


def route_plan(masks: Mapping[str, Tensor], rows: Sequence[Mapping[str, int]], pieces: Sequence[Tensor],
               me: int) -> RoutePlan:
    """Where every feature row goes, for rank ``me``.

    ``masks[m]``: ``[B, S]`` bool, the placeholder tokens of modality m in the whole batch;
    ``rows[r][m]``: the feature rows rank r encoded for modality m (ranks own consecutive ranges,
    in rank order); ``pieces``: the layout (:class:`~seqpar.batch.visual.VisualBatch`). The caller
    checks that each modality's rows add up to its placeholders."""
    p = len(pieces)
    s = next(iter(masks.values())).shape[1]
    rank_of, local_of = _owners(pieces, s)
    lens = [int(idx.numel()) for idx in pieces]
    # one entry per placeholder: (source rank, row on the source, dest rank, sort key on the dest)
    src_l, row_l, dst_l, key_l = [], [], [], []
    for mi, m in enumerate(MODALITIES):
        if m not in masks:
            continue
        b_idx, s_idx = masks[m].cpu().nonzero(as_tuple=True)  # row-major: j-th placeholder of the batch
        n = torch.tensor([r.get(m, 0) for r in rows], dtype=torch.long)
        ends = n.cumsum(0)
        j = torch.arange(b_idx.numel())
        src = torch.searchsorted(ends, j, right=True)
        image_rows = torch.tensor([r.get("image", 0) for r in rows], dtype=torch.long) if m == "video" else 0
        src_l.append(src)
        row_l.append(j - (ends - n)[src] + (image_rows[src] if m == "video" else 0))
        dst = rank_of[s_idx]
        dst_l.append(dst)
        width = torch.tensor(lens, dtype=torch.long)[dst]
        key_l.append(mi * masks[m].shape[0] * max(lens) + b_idx * width + local_of[s_idx])  # modality, then row-major
    src, row, dst, key = (torch.cat(x) if x else torch.zeros(0, dtype=torch.long) for x in (src_l, row_l, dst_l, key_l))
    send = []
    for d in range(p):
        pick = (src == me) & (dst == d)
        send.append(row[pick][torch.argsort(key[pick])])
    mine = dst == me
    recv_counts = [int((src[mine] == r).sum()) for r in range(p)]
    # arrival: by source rank, then in the destination's order; wanted: the destination's order
    arrival = torch.argsort(src[mine] * (int(key.max()) + 1 if key.numel() else 1) + key[mine])
    wanted = torch.argsort(key[mine])
    position = torch.empty_like(arrival)
    position[arrival] = torch.arange(arrival.numel())
    order = position[wanted]
    identity = bool((order == torch.arange(order.numel())).all())
    counts = {m: int((masks[m].cpu().index_select(1, pieces[me].cpu())).sum()) for m in masks}
    return RoutePlan(send, recv_counts, None if identity else order, counts)
