"""Every transformers image-text-to-text family, declared by the mechanisms it uses with images.

seqpar runs a family's images only when every one of its mechanisms is in :data:`SUPPORTED`;
otherwise the first mechanism it cannot run exactly yet is named in the refusal (not the
family). The table is the outcome of reading each modeling file (docs/vlm_mechanisms.md); a
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
# the supported set
SUPPORTED = frozenset({PLACEHOLDER, POSITIONS_1D, MROPE})

# mechanisms seqpar cannot run exactly yet (each one a candidate for the next step)
BIDIRECTIONAL = "bidirectional attention inside each image (a mask from token types)"
DEEPSTACK = "deepstack (visual features added again at early decoder layers)"
CROSS_ATTENTION = "cross-attention from the text to image states"
ENCODER_DECODER = "an encoder-decoder (the text is decoded against an encoder's states)"
PER_ROW_PIXELS = "images batched per row (pixel_values [B, images, ...] with a pixel mask)"
AUDIO = "audio inputs beside the images"
OWN_POSITIONS = "positions from a model-specific scheme seqpar does not feed yet"
NO_PLACEHOLDERS = "image features prepended or interleaved without placeholder tokens"
VQ_TOKENS = "images as discrete tokens from a VQ tokenizer"
UNCLASSIFIED = "a family seqpar has not classified (transformers is newer than seqpar's table)"


@dataclass(frozen=True)
class Family:
    """A family's mechanisms with images; ``frames_apart``: its vision tower attends inside each
    video frame only (``get_vision_cu_seqlens``' default), so a video may be encoded frame by frame."""

    mechanisms: tuple[str, ...]
    frames_apart: bool = False


_LLAVA = Family((PLACEHOLDER, POSITIONS_1D))
_QWEN_VL = Family((PLACEHOLDER, MROPE), frames_apart=True)

FAMILIES: dict[str, Family] = {
    "llava": _LLAVA,
    "qwen2_vl": _QWEN_VL,
    "qwen2_5_vl": _QWEN_VL,
}
"""model_type -> :class:`Family`, for every key of MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES."""


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
