"""Tiny configs and inputs of the diffusers zoo (:mod:`.diffusers_zoo`), per transformer class.

Sizes are chosen so that nothing divides evenly: image / video token counts and text lengths that
are not multiples of 2 or 3, and 3 attention heads where the class allows it (so Ulysses splits
heads unevenly too). Inputs are float64 and drawn from a fixed seed, the same on every rank. A class
without a spec is built from its default config on the meta device: it can only be refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Draw = Callable[..., Tensor]


@dataclass(frozen=True)
class DitSpec:
    """``config``: the class's init arguments; ``inputs(r)``: its forward's keyword arguments, with
    ``r(*shape)`` drawing float64 normals."""

    config: dict[str, Any]
    inputs: Callable[[Draw], dict[str, Any]]


def t(*values: float) -> Tensor:
    """Timesteps (float64)."""
    return torch.tensor(values, dtype=torch.float64)


def make_inputs(name: str, seed: int = 1) -> dict[str, Any]:
    """Class ``name``'s inputs (:data:`SPECS`), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return SPECS[name].inputs(lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64))


def _flux_like(r: Draw, n: int = 13, txt: int = 5, c: int = 4, d: int = 16, pooled: int | None = 8) -> dict[str, Any]:
    out = dict(hidden_states=r(2, n, c), encoder_hidden_states=r(2, txt, d), img_ids=r(n, 3), txt_ids=r(txt, 3),
               timestep=t(0.3, 0.7))
    if pooled:
        out["pooled_projections"] = r(2, pooled)
    return out


def _flux2(r: Draw, n: int = 13, txt: int = 5) -> dict[str, Any]:
    img = torch.stack([torch.zeros(n), torch.arange(n) // 5, torch.arange(n) % 5, torch.zeros(n)], -1)
    txt_ids = torch.stack([torch.zeros(txt), torch.zeros(txt), torch.zeros(txt), torch.arange(txt)], -1)
    return dict(hidden_states=r(2, n, 4), encoder_hidden_states=r(2, txt, 16), timestep=t(0.3, 0.7),
                img_ids=img.expand(2, n, 4).double(), txt_ids=txt_ids.expand(2, txt, 4).double(), guidance=t(1.0, 2.0))


def _qwen(r: Draw) -> dict[str, Any]:
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 5:] = 0  # the first row's last two text tokens are padding
    return dict(hidden_states=r(2, 15, 16), encoder_hidden_states=r(2, 7, 16), encoder_hidden_states_mask=mask,
                timestep=t(0.3, 0.7), img_shapes=[(1, 3, 5)] * 2)


def _sizes(h: int, w: int) -> dict[str, Tensor]:
    return dict(original_size=torch.tensor([[h, w]] * 2), target_size=torch.tensor([[h, w]] * 2),
                crop_coords=torch.zeros(2, 2, dtype=torch.long))


def _wan(r: Draw) -> dict[str, Any]:
    return dict(hidden_states=r(2, 4, 3, 2, 10), encoder_hidden_states=r(2, 7, 16), timestep=t(300, 700))


WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32)
FLUX_LIKE = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
                 num_attention_heads=3, joint_attention_dim=16, axes_dims_rope=(2, 2, 4))

SPECS: dict[str, DitSpec] = {
    "BriaTransformer2DModel": DitSpec({**FLUX_LIKE, "pooled_projection_dim": None, "axes_dims_rope": (0, 4, 4)},
                                      lambda r: _flux_like(r, pooled=None)),
    "ChromaTransformer2DModel": DitSpec({**FLUX_LIKE, "approximator_num_channels": 8, "approximator_hidden_dim": 16,
                                         "approximator_layers": 1}, lambda r: _flux_like(r, pooled=None)),
    "LongCatImageTransformer2DModel": DitSpec({**FLUX_LIKE, "pooled_projection_dim": 8},
                                              lambda r: {**_flux_like(r, pooled=None), "guidance": t(1.0, 2.0)}),
    "OvisImageTransformer2DModel": DitSpec({**FLUX_LIKE, "out_channels": 4}, lambda r: _flux_like(r, pooled=None)),
    "Flux2Transformer2DModel": DitSpec({**FLUX_LIKE, "axes_dims_rope": (2, 2, 2, 2), "timestep_guidance_channels": 16},
                                       _flux2),
    "ChronoEditTransformer3DModel": DitSpec(WAN_TINY, _wan),
    "SkyReelsV2Transformer3DModel": DitSpec(WAN_TINY, _wan),
    "WanVACETransformer3DModel": DitSpec(
        {**WAN_TINY, "vace_layers": [0], "vace_in_channels": 4},
        lambda r: {**_wan(r), "control_hidden_states": r(2, 4, 3, 2, 10)}),
    "AuraFlowTransformer2DModel": DitSpec(
        dict(sample_size=8, patch_size=1, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
             attention_head_dim=8, num_attention_heads=3, caption_projection_dim=24, joint_attention_dim=16,
             out_channels=4, pos_embed_max_size=64),
        lambda r: dict(hidden_states=r(2, 4, 3, 5), encoder_hidden_states=r(2, 7, 16), timestep=t(300, 700))),
    "PixArtTransformer2DModel": DitSpec(
        dict(sample_size=8, num_layers=2, patch_size=1, attention_head_dim=4, num_attention_heads=3, in_channels=4,
             cross_attention_dim=12, out_channels=4, attention_bias=True, activation_fn="gelu-approximate",
             num_embeds_ada_norm=8, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
             use_additional_conditions=False, caption_channels=16),
        lambda r: dict(hidden_states=r(2, 4, 3, 5), encoder_hidden_states=r(2, 7, 16), timestep=t(300, 700),
                       added_cond_kwargs={"aspect_ratio": None, "resolution": None})),
    "DiTTransformer2DModel": DitSpec(
        dict(in_channels=4, out_channels=4, activation_fn="gelu-approximate", num_attention_heads=3,
             attention_head_dim=4, attention_bias=True, num_layers=2, norm_type="ada_norm_zero",
             num_embeds_ada_norm=8, patch_size=1, sample_size=5),
        lambda r: dict(hidden_states=r(2, 4, 5, 5), timestep=torch.tensor([3, 7]),
                       class_labels=torch.tensor([1, 2]))),
    "CogVideoXTransformer3DModel": DitSpec(
        dict(num_attention_heads=3, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
             text_embed_dim=16, num_layers=2, sample_width=10, sample_height=6, sample_frames=1, patch_size=2,
             patch_size_t=None, temporal_compression_ratio=4, max_text_seq_length=7),
        lambda r: dict(hidden_states=r(2, 1, 4, 6, 10), encoder_hidden_states=r(2, 7, 16), timestep=t(300, 700))),
    "CogView3PlusTransformer2DModel": DitSpec(
        dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=3, out_channels=4,
             text_embed_dim=16, time_embed_dim=8, condition_dim=2, pos_embed_max_size=8, sample_size=8),
        lambda r: dict(hidden_states=r(2, 4, 6, 10), encoder_hidden_states=r(2, 7, 16), timestep=t(300, 700),
                       **_sizes(48, 80))),
    "CogView4Transformer2DModel": DitSpec(
        dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4, num_attention_heads=3, out_channels=4,
             text_embed_dim=16, time_embed_dim=8, condition_dim=4),
        lambda r: dict(hidden_states=r(2, 4, 6, 10), encoder_hidden_states=r(2, 7, 16), timestep=t(300, 700),
                       **_sizes(48, 80))),
    "LTXVideoTransformer3DModel": DitSpec(
        dict(in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=8, cross_attention_dim=24,
             num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=16),
        lambda r: dict(hidden_states=r(2, 2 * 3 * 5, 4), encoder_hidden_states=r(2, 7, 16), timestep=t(300, 700),
                       encoder_attention_mask=torch.tensor([[1] * 7, [1] * 5 + [0] * 2]).bool(), num_frames=2,
                       height=3, width=5)),
    "CosmosTransformer3DModel": DitSpec(
        dict(in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=12, num_layers=2, mlp_ratio=2,
             text_embed_dim=16, adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
             rope_scale=(2.0, 1.0, 1.0),
             concat_padding_mask=False, extra_pos_embed_type="learnable"),
        lambda r: dict(hidden_states=r(2, 4, 2, 6, 10), timestep=t(300, 700), encoder_hidden_states=r(2, 7, 16),
                       attention_mask=torch.tensor([[1.0] * 7, [1.0] * 5 + [0.0] * 2]), fps=30)),
    "QwenImageTransformer2DModel": DitSpec(
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=3,
             joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(4, 2, 2)), _qwen),
    "FluxTransformer2DModel": DitSpec(
        dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
             num_attention_heads=3, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4)),
        _flux_like),
    "SD3Transformer2DModel": DitSpec(
        dict(sample_size=8, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=3,
             caption_projection_dim=24, joint_attention_dim=16, pooled_projection_dim=8, out_channels=4,
             pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm"),
        lambda r: dict(hidden_states=r(2, 4, 3, 5), encoder_hidden_states=r(2, 7, 16), pooled_projections=r(2, 8),
                       timestep=t(300, 700))),
    "WanTransformer3DModel": DitSpec(WAN_TINY, _wan),
}
"""Each class's tiny config and inputs, by class name."""

META: dict[str, dict[str, Any]] = {
    # refused classes whose default config does not build at all: the smallest config that does (built on
    # the meta device, only to be refused)
    "EasyAnimateTransformer3DModel": dict(attention_head_dim=16, num_attention_heads=2, in_channels=4, mmdit_layers=2,
                                          num_layers=2, out_channels=4, patch_size=2, sample_height=60,
                                          sample_width=90, text_embed_dim=16, time_embed_dim=8,
                                          time_position_encoding_type="3d_rope", timestep_activation_fn="silu"),
    "HiDreamImageTransformer2DModel": dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                           num_single_layers=1, attention_head_dim=8, num_attention_heads=4,
                                           caption_channels=[8, 4], text_emb_dim=8, num_routed_experts=2,
                                           num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32),
                                           llama_layers=(0, 1)),
    "HunyuanDiT2DModel": dict(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                              num_attention_heads=2, cross_attention_dim=8, cross_attention_dim_t5=8,
                              pooled_projection_dim=4, hidden_size=16, text_len=4, text_len_t5=4),
    "LatteTransformer3DModel": dict(sample_size=8, num_layers=1, patch_size=2, attention_head_dim=4,
                                    num_attention_heads=2, caption_channels=8, in_channels=4, cross_attention_dim=8,
                                    out_channels=8, num_embeds_ada_norm=1000, norm_type="ada_norm_single"),
    "LuminaNextDiT2DModel": dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
                                 num_attention_heads=3, num_kv_heads=1, multiple_of=16, cross_attention_dim=32),
    "OmniGenTransformer2DModel": dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4,
                                      intermediate_size=32, num_layers=2, pad_token_id=0, vocab_size=1000,
                                      in_channels=4, time_step_dim=4,
                                      rope_scaling={"long_factor": [1, 2], "short_factor": [1, 2]}),
    "TransformerTemporalModel": dict(num_attention_heads=8, attention_head_dim=4, in_channels=4, num_layers=1,
                                     norm_num_groups=1),
    "Transformer2DModel": dict(in_channels=4, patch_size=2, sample_size=8, num_attention_heads=2,
                               attention_head_dim=4, norm_type="ada_norm_zero", num_embeds_ada_norm=8),
    "DreamLiteTransformer2DModel": dict(in_channels=32, num_attention_heads=2, attention_head_dim=16),
}
"""Init arguments of refused classes whose default config does not build (see above)."""
