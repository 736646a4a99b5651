"""Synthetic processor outputs for a tiny vision-language model: what its processor would return.

Which tensors a family takes is read from its public methods (the keys ``get_image_features`` /
``get_video_features`` and ``forward`` name), their shapes from its vision config; the number of
placeholder tokens of each image is what the model's own encoder returns for that image alone
(a processor computes the same number from the config)::

    grid     pixel_values [sum t*h*w, C * T * P * P] patch rows, image_grid_thw [n, 3] (Qwen-VL, GLM-4V)
    patches  pixel_values [n, most patches, C * P * P], pixel_attention_mask [n, most], spatial_shapes [n, 2]
             (SigLIP-2 towers of variable size: LFM2-VL)
    stacked  pixel_values [n, C, H, W] one entry per image (LLaVA, InternVL...), image_sizes [n, 2] where the
             tower takes them (Pixtral)
    anyres   pixel_values [n, crops, C, H, W] and image_sizes [n, 2] (LLaVA-NeXT, OneVision: the crops of
             image_grid_pinpoints, counted as the model counts them)
    per row  pixel_values [B, images, C, H, W] and pixel_attention_mask [B, images, H, W], all-zero
             images padding the rows with fewer (Idefics, SmolVLM); the last image half padding
    rows     two rows: row 0 holds two images, row 1 one image (and a video) and right padding;
             placeholders wrapped in the family's start / end tokens, labels -100 on them and on padding;
             mm_token_type_ids (0 text, 1 image, 2 video) and token_type_ids (1 on images) where taken
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from ..batch.targets import IGNORE_INDEX
from ..integrations.vlm.families import family_of

IMAGE_GRIDS = ((1, 4, 4), (1, 4, 8), (1, 8, 4))
"""Patch grids of the three images (multiples of a spatial merge of 2)."""
VIDEO_GRIDS = ((2, 4, 4),)
"""Patch grid of the video: two frames (temporal patches)."""
VIDEO_FRAMES = 2
TEXT = ((3, 2, 3), (2, 2, 2))  # text runs around the images of row 0 and row 1
PAD = 3  # padding tokens at the end of row 1
PATCHES_4D = ("kimi_k25", "paddleocr_vl")
"""Grid families whose patch rows are ``[C, P, P]`` images, not flattened (their towers' first conv)."""
_START_END = (("vision_start_token_id", "vision_end_token_id"), ("image_start_token_id", "image_end_token_id"),
              ("boi_token_id", "eoi_token_id"), ("boi_token_index", "eoi_token_index"))


def _params(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters) if fn is not None else set()


def _required(fn: Any, name: str) -> bool:
    return inspect.signature(fn).parameters[name].default is inspect.Parameter.empty


def _vision_config(model: nn.Module) -> Any:
    return getattr(model.config, "vision_config", None) or model.config


def _size(value: Any, default: int) -> int:
    if isinstance(value, (list, tuple)):
        return int(value[0])
    if isinstance(value, dict):
        return int(next(iter(value.values())))
    return int(value) if isinstance(value, int) else default


def _tower_takes_sizes(model: nn.Module) -> bool:
    """Whether the vision tower itself takes image_sizes (Pixtral's variable sizes), not only the
    model's encoder entry (which may pass them on, or cut features with them)."""
    vc = getattr(model.config, "vision_config", None)
    tower = next((m for m in model.modules() if m is not model and getattr(m, "config", None) is vc), None)
    return tower is not None and "image_sizes" in _params(tower.forward)


def _channels(vc: Any) -> int:
    return next((int(getattr(vc, k)) for k in ("num_channels", "in_channels", "in_chans") if getattr(vc, k, None)), 3)


def _patch_rows(vc: Any, g: torch.Generator) -> list[dict[str, Tensor]]:
    """SigLIP-2 images (LFM2-VL): each image's ``h * w`` patch rows padded to the batch's most,
    with ``pixel_attention_mask [1, most]`` and ``spatial_shapes [[h, w]]`` (in patches)."""
    p = _size(getattr(vc, "patch_size", 4), 4)
    most = max(h * w for _, h, w in IMAGE_GRIDS)
    out = []
    for _, h, w in IMAGE_GRIDS:
        pixels = torch.zeros(1, most, _channels(vc) * p * p, dtype=torch.float64)
        pixels[0, :h * w] = torch.randn(h * w, pixels.shape[-1], generator=g, dtype=torch.float64)
        mask = torch.zeros(1, most, dtype=torch.bool)
        mask[0, :h * w] = True
        out.append({"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": torch.tensor([[h, w]])})
    return out


def pixel_units(model: nn.Module, modality: str, g: torch.Generator) -> list[dict[str, Tensor]]:
    """Each image's (or video's) encoder inputs alone, in the family's layout."""
    fn = getattr(model.base_model, f"get_{modality}_features", None)
    params = _params(fn)
    vc = _vision_config(model)
    pixels = "pixel_values" if modality == "image" else "pixel_values_videos"
    grid_key = f"{modality}_grid_thw"
    dtype = torch.float64
    if grid_key in params:
        p = _size(getattr(vc, "patch_size", 4), 4)
        row = (_channels(vc) * int(getattr(vc, "temporal_patch_size", 1) or 1) * p * p,)
        row = (_channels(vc), p, p) if model.config.model_type in PATCHES_4D else row
        return [{pixels: torch.randn(t * h * w, *row, generator=g, dtype=dtype), grid_key: torch.tensor([[t, h, w]])}
                for t, h, w in (IMAGE_GRIDS if modality == "image" else VIDEO_GRIDS)]
    if modality == "image" and "spatial_shapes" in params:
        return _patch_rows(vc, g)
    size = _size(getattr(vc, "image_size", 8), 8)
    shape = (1, _channels(vc), size, size) if modality == "image" else (1, VIDEO_FRAMES, _channels(vc), size, size)
    n = len(IMAGE_GRIDS) if modality == "image" else len(VIDEO_GRIDS)
    anyres = modality == "image" and "image_sizes" in params and getattr(model.config, "image_grid_pinpoints", None)
    if anyres:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        crops = image_size_to_num_patches((size, size), model.config.image_grid_pinpoints, size)
        shape = (1, crops, _channels(vc), size, size)
    if modality == "image" and "pixel_attention_mask" in params:  # per row: [1 row, 1 image, ...]
        shape = (1, 1, _channels(vc), size, size)
    out = []
    for i in range(n):
        unit = {pixels: torch.randn(*shape, generator=g, dtype=dtype)}
        if modality == "image" and "image_sizes" in params and (anyres or _tower_takes_sizes(model)
                                                                or _required(fn, "image_sizes")):
            unit["image_sizes"] = torch.tensor([[size, size]])
        if modality == "image" and "pixel_attention_mask" in params:
            mask = torch.ones(1, 1, size, size, dtype=torch.bool)
            if i == n - 1:  # a smaller image, padded to the batch's size with zeros its mask leaves out
                mask[..., size // 2:, :] = False
                unit[pixels] = unit[pixels] * mask[:, :, None]
            unit["pixel_attention_mask"] = mask
        out.append(unit)
    return out


def _per_row(images: list[dict[str, Tensor]], rows: list[list[int]]) -> dict[str, Tensor]:
    """``[B, images, ...]`` pixels and masks of per-row families: row r holds images ``rows[r]``,
    the shorter rows padded with all-zero images (what their processors do)."""
    most = max(len(r) for r in rows)
    out = {}
    for key in images[0]:
        one = images[0][key][0, 0]
        out[key] = torch.stack([torch.stack([images[i][key][0, 0] for i in r]
                                            + [torch.zeros_like(one)] * (most - len(r))) for r in rows])
    return out


def feature_rows(model: nn.Module, modality: str, unit: dict[str, Tensor]) -> int:
    """How many feature rows (= placeholder tokens) the model's encoder gives one image / video."""
    fn = getattr(model.base_model, f"get_{modality}_features")
    with torch.no_grad():
        out = fn(**unit, return_dict=True)
    pooled = out.pooler_output if out.pooler_output is not None else out.deepstack_features[0][1]  # Granite 4
    return sum(int(f.reshape(-1, f.shape[-1]).shape[0]) for f in pooled)


def _wrap(model: nn.Module, token: int, n: int) -> list[int]:
    cfg = model.config
    for start, end in _START_END:
        a, b = getattr(cfg, start, None), getattr(cfg, end, None)
        if isinstance(a, int) and isinstance(b, int):
            return [a, *[token] * n, b]
    return [token] * n


def _videos_in_image_tokens(model: nn.Module) -> bool:
    """Whether the model's video placeholders are its image tokens (GLM-4.1V / 4.5V, GLM-5-next):
    then the harness gives it images only."""
    mask = getattr(model.base_model, "get_placeholder_mask", None)
    source = inspect.getsource(mask) if mask is not None else ""
    # GLM-4.1V: video tokens are image tokens; GLM-5-next: image tokens inside a video's start / end span
    return "special_video_mask = input_ids == self.config.image_token_id" in source or "in_video_span" in source


def _frames_apart_in_text(model: nn.Module) -> bool:
    """Whether the processor writes a video frame by frame, each frame's placeholders wrapped
    apart after a timestamp (Qwen3-VL, GLM-4V: their rope index splits video grids by frame)."""
    rope_index = getattr(model.base_model, "get_rope_index", None)
    return rope_index is not None and "video_grid_thw[:, 0]" in inspect.getsource(rope_index)


def _video_tokens(model: nn.Module, token: int, n: int, frames: int, g: torch.Generator, vocab: int) -> list[int]:
    if not _frames_apart_in_text(model):
        return _wrap(model, token, n)
    out = []
    for _ in range(frames):  # "<t seconds>" as one text token, then the frame
        out += torch.randint(3, vocab - 40, (1,), generator=g).tolist() + _wrap(model, token, n // frames)
    return out


def _token(model: nn.Module, modality: str) -> int:
    tok = getattr(model.config, f"{modality}_token_id", None)
    if tok is None:
        raise ValueError(f"config has no {modality}_token_id: the harness cannot place {modality} tokens")
    return int(tok)


def vlm_batch(model: nn.Module, seed: int = 0, lead: int = 0) -> dict[str, Tensor]:
    """The family's processor-like batch (see the module doc), the same on every rank. ``lead``:
    extra text tokens before the first image (moves the images against the shard boundaries)."""
    g = torch.Generator().manual_seed(1000 + seed)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    fwd = _params(model.forward)
    images = pixel_units(model, "image", g)
    videos = pixel_units(model, "video", g) if getattr(model.base_model, "get_video_features", None) else []
    videos = videos if "pixel_values_videos" in fwd and not _videos_in_image_tokens(model) else []
    n_img = [feature_rows(model, "image", u) for u in images]
    n_vid = [feature_rows(model, "video", u) for u in videos]

    def text(n: int) -> list[int]:
        return torch.randint(3, vocab - 40, (n,), generator=g).tolist()

    img_tok = _token(model, "image")
    vid_tok = _token(model, "video") if videos else None
    row0 = (text(TEXT[0][0] + lead) + _wrap(model, img_tok, n_img[0]) + text(TEXT[0][1])
            + _wrap(model, img_tok, n_img[1]) + text(TEXT[0][2]))
    row1 = text(TEXT[1][0]) + _wrap(model, img_tok, n_img[2]) + text(TEXT[1][1])
    if videos:
        row1 += _video_tokens(model, vid_tok, n_vid[0], VIDEO_GRIDS[0][0], g, vocab)
    row1 += text(TEXT[1][2])
    s = max(len(row0), len(row1) + PAD)
    row0 += text(s - len(row0))
    mask = torch.ones(2, s, dtype=torch.long)
    mask[1, len(row1):] = 0
    row1 += [0] * (s - len(row1))
    ids = torch.tensor([row0, row1])
    batch: dict[str, Tensor] = {"input_ids": ids, "attention_mask": mask}
    if "pixel_attention_mask" in images[0] and images[0]["pixel_values"].dim() == 5:  # per row
        batch.update(_per_row(images, [[0, 1], [2]]))
    else:
        for key in images[0]:
            batch[key] = torch.cat([u[key] for u in images])
    for key in videos[0] if videos else {}:
        batch[key] = torch.cat([u[key] for u in videos])
    is_img, is_vid = ids == img_tok, (ids == vid_tok) if vid_tok is not None else torch.zeros_like(ids, dtype=bool)
    if "mm_token_type_ids" in fwd:
        batch["mm_token_type_ids"] = is_img.long() + 2 * is_vid.long()
    if "token_type_ids" in fwd:
        batch["token_type_ids"] = _token_types(model, is_img, mask)
    labels = ids.clone()
    labels[is_img | is_vid | (mask == 0)] = IGNORE_INDEX
    batch["labels"] = labels
    return batch


def _token_types(model: nn.Module, is_img: Tensor, mask: Tensor) -> Tensor:
    """``token_type_ids`` as the family's processor makes them: 1 on image tokens (Gemma 3), or 0 on
    the prefix -- through two tokens past the row's last image -- and 1 on the suffix, padding 0
    (PaliGemma: the prefix is one bidirectional span, and not contiguous with right padding)."""
    if family_of(model).spans != "prefix":
        return is_img.long()
    idx = torch.arange(is_img.shape[1]).expand_as(is_img)
    last = torch.where(is_img, idx, -1).amax(dim=1, keepdim=True)  # [B, 1]
    return ((idx > last + 2) & (mask == 1)).long()


def packed_batch(batch: dict[str, Tensor], tail: int = PAD) -> dict[str, Tensor]:
    """``batch``'s rows packed into one row (what a flattening collator makes): the documents'
    tokens back to back, ``position_ids`` restarting at 0 for each, then ``tail`` padding tokens;
    the visual tensors unchanged (the images stay in row-major order). Its reference is ``batch``
    itself, unpacked: each document run as its own row. Not for per-row pixels (Idefics), whose
    pixels are laid out by row."""
    if batch["pixel_values"].dim() == 5 and "pixel_attention_mask" in batch:
        raise ValueError("packed_batch does not re-lay per-row pixels")
    keep = batch["attention_mask"].bool()
    seq = {k: [batch[k][b][keep[b]] for b in range(keep.shape[0])]
           for k in ("input_ids", "labels", "mm_token_type_ids") if k in batch}
    pos = [torch.arange(int(k.sum())) for k in keep]
    out = {k: v for k, v in batch.items() if k not in seq and k != "attention_mask"}
    for k, parts in seq.items():
        fill = IGNORE_INDEX if k == "labels" else 0
        out[k] = torch.cat([*parts, parts[0].new_full((tail,), fill)])[None]
    out["position_ids"] = torch.cat([*pos, torch.arange(tail)])[None]
    out["attention_mask"] = torch.cat([torch.ones(sum(len(p) for p in pos), dtype=torch.long),
                                       torch.zeros(tail, dtype=torch.long)])[None]
    return out
