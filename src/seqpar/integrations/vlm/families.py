"""Every transformers image-text-to-text family, declared by the mechanisms it uses with images.

seqpar runs a family's images only when every one of its mechanisms is in :data:`SUPPORTED`;
otherwise the first mechanism it cannot run exactly yet is named in the refusal (not the
family). The table is the outcome of reading each modeling file (docs/guides/vlm-mechanisms.md); a
family missing from it (a newer transformers) is refused until someone classifies it.
Text-only rows of every family run as before (they are causal LMs).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# how image features enter the text
PLACEHOLDER = "placeholder merge"  # features masked_scatter'ed at image / video placeholder tokens
# positions
POSITIONS_1D = "1-D positions"
MROPE = "M-RoPE"  # 3-D positions from the model's public get_rope_index
DEEPSTACK = ("deepstack (visual features added again to the image tokens' hidden states at early decoder layers: "
             "routed beside the main features, added at this shard's placeholders)")
PER_ROW_PIXELS = ("images batched per row (pixel_values [B, images, ...] with a pixel_attention_mask; all-zero "
                  "images pad the rows: each real image is a unit of vision work)")
VQ_TOKENS = ("image codes from a VQ tokenizer embedded as text tokens (each image tokenized alone; no gradient "
             "reaches the tokenizer)")
SPANS_IMAGES = ("bidirectional attention inside each image (token_type_ids: each run of image tokens one span of "
                "seqpar's structural mask, OR-ed with causal on every layer, window AND-ed)")
SPANS_PREFIX = ("bidirectional attention over the prefix (token_type_ids == 0: image and prompt one span of seqpar's "
                "structural mask, OR-ed with causal)")
ONE_BASED_POSITIONS = ("positions counted from 1 (the model adds 1 to the position ids it computes: seqpar gives it "
                       "those positions when the batch brings none)")
# the supported set
SUPPORTED = frozenset({PLACEHOLDER, POSITIONS_1D, MROPE, DEEPSTACK, PER_ROW_PIXELS, VQ_TOKENS, SPANS_IMAGES,
                       SPANS_PREFIX, ONE_BASED_POSITIONS})

# mechanisms seqpar cannot run exactly yet (each one a candidate for the next step)
BIDIRECTIONAL = ("bidirectional attention seqpar's spans (the same on every layer, from token_type_ids) do not "
                 "express yet: Gemma 4 ORs each image's span into its sliding layers only (full layers causal), "
                 "Molmo 2 one span of every image token from mm_token_type_ids, DiffusionGemma block diffusion")
CROSS_ATTENTION = "cross-attention from the text to image states (no placeholder tokens)"
ENCODER_DECODER = "an encoder-decoder (the text is decoded against an encoder's states)"
NO_PLACEHOLDERS = "image embeddings prepended or placed without placeholder tokens (GIT, BLIP-2 queries, Kosmos-2)"
OWN_INPUTS = "visual inputs of the family's own (crop sizes, merge sizes, raw patches) that seqpar does not route"
MODALITY_EXPERTS = "experts routed by modality (moe_mm_token_type_ids)"
EXTRA_OUTPUTS = "encoder outputs beside the image features that the model reads (Ovis2's visual indicators)"
VIDEO_SPANS = ("video placeholders that are image tokens told apart by their enclosing video start / end tokens "
               "(a count over the whole row, which a shard cannot see)")
TILE_MASK = ("per-row tiles marked by a tile mask (pixel_attention_mask [B, tiles], Granite-Docling), which seqpar "
             "does not cut into units of vision work yet")
NO_VISION = "no vision entry (a text-only class in the image-text-to-text mapping)"
UNVERIFIED = ("a family whose tiny model the VLM zoo cannot build or run (transformers' own error), so seqpar has not "
              "checked it with images")
UNCLASSIFIED = "a family seqpar has not classified (transformers is newer than seqpar's table)"


@dataclass(frozen=True)
class Family:
    """A family's mechanisms with images. ``frames_apart``: its vision tower attends inside each
    video frame only (``get_vision_cu_seqlens``' default), so a video may be encoded frame by frame;
    ``video_token``: which placeholder a video's features fill (GLM-4V: the image token);
    ``per_row``: its pixels come per row (``[B, images, C, H, W]``, Idefics); ``spans``: how its
    ``token_type_ids`` become bidirectional span ids (:data:`seqpar.integrations.vlm.spans.SPAN_RULES`:
    ``"images"``, ``"prefix"``) or None (it has no such mask); ``one_based``: it adds 1 to the
    positions it computes itself; ``causal_mask``: its text layers say ``is_causal=False`` but the
    model always builds them a causal mask (PaliGemma sets ``use_bidirectional_attention`` so
    that SDPA reads its prefix mask), so seqpar's attention is causal there."""

    mechanisms: tuple[str, ...]
    frames_apart: bool = False
    video_token: str = "video"
    per_row: bool = False
    spans: str | None = None
    one_based: bool = False
    causal_mask: bool = False


_1D = Family((PLACEHOLDER, POSITIONS_1D))
_MROPE = Family((PLACEHOLDER, MROPE), frames_apart=True)
_GLM = Family((PLACEHOLDER, MROPE), frames_apart=True, video_token="image")
_UNVERIFIED = Family((PLACEHOLDER, UNVERIFIED))

FAMILIES: dict[str, Family] = {
    # features scattered at placeholder tokens, 1-D positions
    **dict.fromkeys(["aria", "aya_vision", "cohere2_vision", "deepseek_vl", "exaone4_5", "got_ocr2", "pp_chart2table",
                     "hyperclovax_vision_v2", "internvl", "janus", "kimi_k25", "lighton_ocr", "llava", "llava_next",
                     "llava_next_video", "llava_onevision", "minimax_m3_vl", "mistral3", "mistral_large4",
                     "qianfan_ocr", "step3p7", "video_llava", "vipllava", "lfm3_vl"], _1D),
    # ... with 3-D M-RoPE positions from get_rope_index
    **dict.fromkeys(["qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe", "cosmos3_edge", "hunyuan_vl", "paddleocr_vl",
                     "qwen2_5_omni_thinker", "hy_v4_vl", "qwen4_exp"], _MROPE),
    **dict.fromkeys(["dots3_note", "llava_onevision1_5"], Family((PLACEHOLDER, POSITIONS_1D), frames_apart=True)),
    "glm5_next": Family((PLACEHOLDER, POSITIONS_1D, VIDEO_SPANS), frames_apart=True),
    **dict.fromkeys(["glm4v", "glm4v_moe", "glm46v", "glmga", "glm_ocr"], _GLM),
    "ernie4_5_vl_moe": Family((PLACEHOLDER, MROPE, MODALITY_EXPERTS)),
    **dict.fromkeys(["ovis2", "ovis2_5"], Family((PLACEHOLDER, EXTRA_OUTPUTS))),  # 2.5: indicators at start / end
    # masks, extra paths and layouts seqpar does not run yet
    # ShieldGemma 2's image-text-to-text class is Gemma3ForConditionalGeneration
    **dict.fromkeys(["gemma3", "shieldgemma2"], Family((PLACEHOLDER, POSITIONS_1D, SPANS_IMAGES), spans="images")),
    "paligemma": Family((PLACEHOLDER, POSITIONS_1D, SPANS_PREFIX, ONE_BASED_POSITIONS), spans="prefix",
                        one_based=True, causal_mask=True),
    **dict.fromkeys(["gemma4", "gemma4_unified", "molmo2", "diffusion_gemma"],
                    Family((PLACEHOLDER, BIDIRECTIONAL))),
    **dict.fromkeys(["qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe_thinker", "cosmos3_omni"],
                    Family((PLACEHOLDER, MROPE, DEEPSTACK), frames_apart=True)),
    "cohere_compass": Family((PLACEHOLDER, MROPE, DEEPSTACK), frames_apart=True),
    "granite4_vision": Family((PLACEHOLDER, POSITIONS_1D, DEEPSTACK)),  # (decoder layer, rows) pairs only
    **dict.fromkeys(["idefics2", "idefics3", "smolvlm"], Family((PLACEHOLDER, POSITIONS_1D, PER_ROW_PIXELS),
                                                               per_row=True)),
    "granite_docling": Family((PLACEHOLDER, POSITIONS_1D, TILE_MASK, DEEPSTACK)),
    "lfm2_vl": _1D,
    **dict.fromkeys(["deepseek_vl_hybrid", "fuyu", "minicpm_ocr", "minicpmv4_6", "minicpmv4_7", "nemotron_h_omni",
                     "video_llama_3"], Family((PLACEHOLDER, OWN_INPUTS))),
    **dict.fromkeys(["blip", "idefics", "mllama", "evolla"], Family((CROSS_ATTENTION,))),
    **dict.fromkeys(["florence2", "pix2struct", "pp_formulanet", "t5gemma2", "udop", "vision-encoder-decoder"],
                    Family((ENCODER_DECODER,))),
    **dict.fromkeys(["git", "blip-2", "instructblip", "instructblipvideo", "kosmos-2", "kosmos-2.5", "pi0", "pi05"],
                    Family((NO_PLACEHOLDERS,))),
    "mistral4": Family((NO_VISION,)),
    # placeholder merges by their modeling files, not run: their tiny configs do not build or run here
    "apertus1p5": Family((PLACEHOLDER, POSITIONS_1D, VQ_TOKENS)),
    **dict.fromkeys(["chameleon", "deepseek_ocr2", "emu3", "fast_vlm", "gemma3n", "inkling2", "inkling2_loop",
                     "inkling_mm_model", "llama4", "muse_glimmer", "muse_spark", "perception_lm", "unlimited_ocr"],
                    _UNVERIFIED),
}
"""model_type -> :class:`Family`, for every key of MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES."""

SINCE = {"llava_onevision1_5": "5.25.0", "ovis2_5": "5.25.0", "pi05": "5.25.0"}
"""Families of :data:`FAMILIES` that an older transformers of the tested set does not ship: the
release that added them (the table covers every tested release)."""


def family_of(model: nn.Module) -> Family:
    return FAMILIES.get(getattr(model.config, "model_type", ""), Family((UNCLASSIFIED,)))


def family_problem(model: nn.Module) -> str | None:
    """The first mechanism of the model's family seqpar cannot run with images, or None."""
    for mechanism in family_of(model).mechanisms:
        if mechanism not in SUPPORTED:
            return (f"seqpar cannot run {mechanism} under sequence parallelism yet; it runs "
                    f"{sorted(SUPPORTED)} (text-only rows of this model do run)")
    return None


def frames_apart(model: nn.Module) -> bool:
    return family_of(model).frames_apart


def per_row(model: nn.Module) -> bool:
    return family_of(model).per_row


def placeholder_token(model: nn.Module, modality: str) -> str:
    """Which placeholder token (``"image"`` or ``"video"``) takes ``modality``'s features."""
    return family_of(model).video_token if modality == "video" else "image"
