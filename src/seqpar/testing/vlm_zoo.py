"""The VLM zoo: every image-text-to-text class the installed transformers ships, tiny and in float64,
with images (and a video where the model takes one) made the way its processor would make them.

Families are enumerated from transformers' ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` (never
hand-picked). Each default config is shrunk by the causal-LM zoo's rules (:func:`seqpar.testing.zoo.
shrink_config`: hidden 32, 4 heads, 2 layers, ...) plus the vision rules of :data:`VISION_TINY` (a
two-layer tower on 8 x 8 images of 4 x 4 patches), special token ids moved into the tiny
vocabulary, M-RoPE sections fitted to the tiny head, and the per-family fixes of
:data:`FAMILY_FIXES` (one table). Inputs (:mod:`.vlm_inputs`) follow the processor: placeholder
tokens per image as many as the model's own encoder returns for it, grids, sizes, token types,
two rows with 1-3 images, a video where the model takes one, and a padded row. Outcomes of the
unsharded run (:func:`run_unsharded`)::

    runs         loss and every gradient (vision tower included) computed: the reference SP runs
                 are compared to
    unbuildable  transformers cannot build the tiny config (its own error, quoted)
    no inputs    the harness cannot make this family's visual inputs (the reason)
    fails        transformers raised running the model on them (its own error, quoted)
"""

from __future__ import annotations

import inspect
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..batch.targets import IGNORE_INDEX
from .router64 import collect, router_term
from .vlm_inputs import vlm_batch
from .zoo import TINY, shrink_config

VISION_TINY: dict[str, Any] = dict(
    depth=2, embed_dim=32, out_hidden_size=32, image_size=8, patch_size=4, window_size=16,
    fullatt_block_indexes=[1], hidden_size=32, intermediate_size=64, num_attention_heads=4, num_heads=4,
    projection_dim=32, text_hidden_size=32, deepstack_visual_indexes=[0, 1],
)
"""Vision sub-config fields set where a family's vision config has them."""

EXTRA_TINY: dict[str, int] = dict(
    embed_dim=32, layers=2, attention_heads=4, ffn_dim=64, encoder_attention_heads=4, encoder_layers=2,
    encoder_ffn_dim=64, projection_dim=32, projector_hidden_size=64, projection_hidden_size=32, latent_query_num=4,
    num_query_tokens=4, base_channels=32,
)
"""Size fields of other names (Kosmos' text, audio encoders, projectors, VQ tokenizers), set in
every (sub-)config that has them."""

_PIXTRAL = {"vision_config": {"image_size": 16}}  # 4 x 4 patches, 2 x 2 merged: 4 tokens per image
_ANYRES = {"image_grid_pinpoints": [[8, 8], [8, 16], [16, 8]]}  # LLaVA-NeXT crops at the tiny size
_PER_ROW = {"vision_config": {"image_size": 16}}  # 4 x 4 patches, pixel-shuffled by 2: 4 tokens
FAMILY_FIXES: dict[str, dict[str, Any]] = {
    "gemma3": {"mm_tokens_per_image": 4}, "shieldgemma2": {"mm_tokens_per_image": 4},  # 2 x 2 pooled
    "vipllava": {"vision_feature_layer": [-2, -1]},  # its default reads layers -11 and 6
    "aria": {"projector_patch_to_query_dict": {4: 2}},  # 4 patches -> 2 queries
    "mistral3": _PIXTRAL, "mistral_large4": _PIXTRAL, "lighton_ocr": _PIXTRAL,
    "llava_next": _ANYRES, "llava_next_video": _ANYRES, "llava_onevision": _ANYRES,
    "step3p7": {"text_config": {"sliding_window": 8}},  # its default leaves the window unset
    "hy_v4_vl": {"text_config": {"qk_rope_head_dim": 8}},  # M-RoPE sections [2, 1, 1] need 4 frequencies
    # its rotary pairs the h and w sections frequency by frequency: equal sections ([2, 1, 1] does not run)
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"mrope_section": [1, 1, 2]}}},
    # VQ tokenizers: image / audio codes are token ids past image_token_offset (a small range here)
    "apertus1p5": {"audio_config": {"codebook_dim": 32, "codebook_size": 16},
                   "vision_config": {"codebook_size": 16, "channel_multiplier": [1, 2], "num_res_blocks": 1},
                   "image_token_offset": 200, "audio_token_offset": 216},
    # their rope index reads config.vision_start_token_id, which their default configs do not set
    "glm4v_moe": {"text_config": {"head_dim": 16}},  # partial rotary (0.5): 4 frequencies for the 3 sections
    "qwen2_5_omni_thinker": {"vision_start_token_id": 200}, "qwen3_omni_moe_thinker": {"vision_start_token_id": 200},
    # indexed (sparse) attention: its indexer sized for the tiny head (parallelize refuses the text decoder)
    "qwen4_exp": {"text_config": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8,
                                  "indexer_budget": 8, "indexer_compress_ratio": 2}},
    "dots3_note": {"text_config": {"head_dim": 12},  # its sliding layers: qk_nope + qk_rope
                   "vision_config": {"adapter_in_dim": 32, "adapter_out_dim": 32,
                                     "mlp_layer_types": ["dense", "dense"]},
                   "audio_config": {"adapter_input_size": 32, "adapter_out_dim": 32}},
    "glm5_next": {"text_config": {"index_kpool": 2, "qk_rope_head_dim": 0}},  # its DSA layers take no RoPE
    # per-layer-type RoPE, unset by default; M-RoPE sections for the tiny head (4 frequencies)
    "cohere_compass": {"text_config": {"rope_parameters": {"full_attention": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}}}},
    # Window Q-Former heads are vision hidden // 64; deepstack and spatial groups at the two tiny layers
    "granite4_vision": {"vision_config": {"hidden_size": 64, "image_size": 16}, "downsample_rate": "1/2",
                        "deepstack_layer_map": [[-1, 0], [-2, 1]], "spatial_target_layers": [0, 1, 0, 1],
                        "image_grid_pinpoints": [[16, 16], [16, 32], [32, 16]]},
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},
    "idefics2": {**_PER_ROW, "perceiver_config": {"resampler_n_latents": 4}},
    "idefics3": _PER_ROW, "smolvlm": _PER_ROW, "granite_docling": _PER_ROW,
}
"""Per-family config fields (nested dicts merge into sub-configs), set after the generic shrink."""

_VOCAB = int(TINY["vocab_size"])
_KEEP_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def vlm_types() -> list[str]:
    """Every model type transformers maps to an image-text-to-text class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def model_class(model_type: str) -> type:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])


def _token_ids(d: dict[str, Any], taken: dict[int, str]) -> None:
    """Move special token ids beyond the tiny vocabulary to its top, one distinct id each (in place)."""
    for key in sorted(d):
        val = d[key]
        is_id = key.endswith(("_token_id", "_token_index", "_token_ids")) and key not in _KEEP_IDS
        if is_id and isinstance(val, int) and not isinstance(val, bool) and val >= _VOCAB - 32:
            d[key] = _VOCAB - 1 - len(taken)
            taken[d[key]] = key
        elif is_id and isinstance(val, list) and all(isinstance(v, int) for v in val):
            d[key] = [_VOCAB - 1 - len(taken) - i for i in range(len(val))]
            taken.update({v: key for v in d[key]})


def _merge(d: dict[str, Any], fixes: dict[str, Any]) -> dict[str, Any]:
    out = dict(d)
    for k, v in fixes.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _extra_tiny(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and ("model_type" in v or k.endswith("config")):
            out[k] = _extra_tiny(v)
        elif k in EXTRA_TINY and isinstance(v, int) and not isinstance(v, bool):
            out[k] = EXTRA_TINY[k]
        elif "drop" in k and isinstance(v, float):  # drop_path_rate too: no randomness in train mode
            out[k] = 0.0
        else:
            out[k] = v
    return out


def _uses_rope_index(model_type: str) -> bool:
    return "def get_rope_index" in inspect.getsource(sys.modules[model_class(model_type).__module__])


def tiny_vlm_config(model_type: str) -> Any:
    """The family's default config, shrunk (see the module doc)."""
    from transformers import AutoConfig

    return type(AutoConfig.for_model(model_type)).from_dict(tiny_vlm_dict(model_type))


def tiny_vlm_dict(model_type: str) -> dict[str, Any]:
    """The shrunk config as a dict (before transformers validates it)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    # MoE router logits on and the aux loss weighted (the causal-LM zoo's SWITCHED_ON / TINY):
    # vlm_reference adds the whole batch's aux term
    d = _extra_tiny(shrink_config(config.to_dict()))
    for key, sub in list(d.items()):
        if isinstance(sub, dict) and "vision" in key:
            d[key] = {**sub, **{k: ([v] * len(sub[k]) if isinstance(sub[k], list) and not isinstance(v, list) else v)
                                for k, v in VISION_TINY.items() if k in sub}}  # [8, 8] where a list is taken
    taken: dict[int, str] = {}
    _token_ids(d, taken)
    text = d.get("text_config")
    if isinstance(text, dict):
        _token_ids(text, taken)
        rope = text.get("rope_parameters")
        if isinstance(rope, dict) and "rope_type" in rope and _uses_rope_index(model_type):
            text["rope_parameters"] = {**rope, "mrope_section": [2, 1, 1]}  # head_dim 8: 4 frequencies
    d = _merge(d, FAMILY_FIXES.get(model_type, {}))
    for key in ("model_type", "transformers_version"):
        d.pop(key, None)
    return d


def build_tiny_vlm(model_type: str, seed: int = 0) -> nn.Module:
    """The family's tiny model in float64, train mode, matrices redrawn at unit gain (as the
    causal-LM zoo does); the same on every rank."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = tiny_vlm_config(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_config(config, experts_implementation="eager")
    model = model.to(torch.float64).train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (1.5 / p[0].numel() ** 0.5))
    return model


def load_vlm(path: str) -> nn.Module:
    """A local image-text-to-text checkpoint in float64 and train mode (MoE experts on
    transformers' eager loop, which has float64)."""
    from transformers import AutoModelForImageTextToText

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
    return model.train()


def is_vlm_checkpoint(path: str) -> bool:
    """Whether the checkpoint directory ``path`` holds an image-text-to-text model (its config's
    model_type is in transformers' mapping)."""
    import json
    import os

    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return json.load(f).get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def vlm_token_loss(model: nn.Module, batch: dict[str, Tensor], routers: list[Any] | None = None
                   ) -> tuple[Tensor, int]:
    """The unsharded model on the whole batch: ``(sum of the float64 token losses, targets)``.
    ``routers``: the forward's router logits are appended to it, for the MoE aux loss of the whole
    batch (:mod:`.router64`)."""
    kw = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**kw, use_cache=False)
    collect(out, kw.get("attention_mask"), routers)
    logits = out.logits  # [B, S, V]
    targets = batch["labels"][:, 1:]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).to(torch.float64), targets.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="sum")
    return ce, int((targets != IGNORE_INDEX).sum())


def vlm_reference(model: nn.Module, batch: dict[str, Tensor], *, loss_scale: float = 1.0
                  ) -> tuple[float, dict[str, Tensor | None]]:
    """The unsharded token-mean loss, plus ``coef * aux`` of the whole batch for an MoE model with
    router logits on (:mod:`.router64`, as :func:`~seqpar.testing.model_parity.reference_loss`), and
    every parameter's gradient (``model``'s grads reset).

    ``loss_scale``: back-propagate ``loss_scale * loss`` and divide the gradients by it, as
    :func:`~seqpar.testing.model_parity.reference_grads` does: seqpar's loss runs at the SP size's
    scale, and a model that casts to float32 inside rounds its gradients at that scale."""
    model.zero_grad(set_to_none=True)
    runs: list[Any] = []
    total, n = vlm_token_loss(model, batch, runs)
    loss = total / n + router_term(model, runs)
    (loss * loss_scale if loss_scale != 1.0 else loss).backward()
    grads = {name: (q.grad / loss_scale if loss_scale != 1.0 and q.grad is not None else q.grad)
             for name, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


@dataclass(frozen=True)
class VlmRow:
    """One family's unsharded run (see the module doc for ``status``)."""

    family: str
    status: str
    detail: str = ""
    loss: float = 0.0
    vision_grads: int = 0  # vision-side parameters with a nonzero gradient
    images: int = 0  # image placeholder tokens in the batch
    videos: int = 0  # video placeholder tokens


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def vision_params(model: nn.Module) -> list[str]:
    """Names of the parameters outside the language model and the head (tower and projector)."""
    lm = {id(p) for p in model.get_decoder().parameters()} | {id(model.get_output_embeddings().weight)}
    lm |= {id(model.get_input_embeddings().weight)}
    return [n for n, p in model.named_parameters() if id(p) not in lm]


def run_unsharded(model_type: str) -> VlmRow:
    """Build the family's tiny model, make its inputs and run loss + backward without seqpar."""
    try:
        model = build_tiny_vlm(model_type)
    except Exception as e:
        return VlmRow(model_type, "unbuildable", _first_line(e))
    try:
        batch = vlm_batch(model)
    except Exception as e:
        return VlmRow(model_type, "no inputs", _first_line(e))
    try:
        loss, grads = vlm_reference(model, batch)
    except Exception as e:
        return VlmRow(model_type, "fails", _first_line(e))
    vision = [n for n in vision_params(model) if grads[n] is not None and bool(grads[n].abs().sum() > 0)]
    ids = batch["input_ids"]
    tokens = {m: getattr(model.config, f"{m}_token_id", None) for m in ("image", "video")}
    n = {m: int((ids == t).sum()) if isinstance(t, int) else 0 for m, t in tokens.items()}
    return VlmRow(model_type, "runs", "", loss, len(vision), images=n["image"], videos=n["video"])
