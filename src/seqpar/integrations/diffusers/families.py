"""Which diffusers transformer classes seqpar runs, and how: one :class:`Family` declaration per class,
or the reason it is refused (:data:`.refused.REFUSED`). Declared, never guessed from the model's structure:
a class that is in neither table is refused, and the diffusers zoo (:mod:`seqpar.testing.diffusers_zoo`)
checks every declared class against itself unsharded, so a wrong declaration fails a test.

A family says where its sequences are split and leave (its ``_cp_plan``, labelled, or a
:class:`~.plan.ShardPlan` written here), which attention modules attend over which sequences --
self-attention over the image tokens (``("image",)``), joint attention over text and image
(``("text", "image")``: MMDiT, text sharded like the image), or ``None``: cross-attention to
text every rank holds whole, left local -- and how its whole output is laid out in tokens
(:mod:`.layouts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...errors import Refused
from .plan import Gather, ShardPlan, Split, from_cp_plan
from .refused import REFUSED

JOINT = ("text", "image")
IMAGE = ("image",)
CROSS = None


@dataclass(frozen=True)
class Family:
    """How seqpar runs one diffusers transformer class.

    ``attention``: attention module path pattern (``*`` one ModuleList item) -> the sequences it
    attends over, or None for cross-attention left local. Every attention module of the model must
    match one pattern. ``plan``: where sequences are split and leave; None: the class's ``_cp_plan``,
    its entries labelled by ``labels`` (``"module:key"`` or ``"key"`` -> sequence) over
    :data:`~.plan.DEFAULT_SEQUENCES`. ``output``: the whole output's token layout (:data:`.layouts.LAYOUTS`).
    ``refuse_inputs``: forward inputs seqpar does not shard (ControlNet residuals that would enter the
    sharded region whole, masks over several sequences at once, modes with an S x S mask): refused
    when given (not None, not False). ``requires``: config values the declaration holds for, each
    with the reason another value is refused.
    """

    attention: Mapping[str, tuple[str, ...] | None]
    plan: ShardPlan | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    output: str = "tokens"
    refuse_inputs: tuple[str, ...] = ()
    requires: Mapping[str, tuple[Any, str]] = field(default_factory=dict)

    def check_config(self, model: nn.Module) -> None:
        """Raise Refused when ``model``'s config leaves what this declaration holds for."""
        for key, (value, why) in self.requires.items():
            have = getattr(model.config, key, value)
            if have != value:
                raise Refused(f"seqpar does not parallelize {type(model).__name__} with {key}={have!r}: {why} "
                              f"(it runs {key}={value!r})")

    def shard_plan(self, model: nn.Module) -> ShardPlan:
        """The plan for ``model``: the declared one, or its ``_cp_plan`` labelled."""
        if self.plan is not None:
            return self.plan
        return from_cp_plan(model, self.labels)


FLUX_ATTENTION = {"transformer_blocks.*.attn": JOINT, "single_transformer_blocks.*.attn": JOINT}
FLUX_PLAN = ShardPlan({"": {"hidden_states": Split("image", 1, 3), "encoder_hidden_states": Split("text", 1, 3),
                            "img_ids": Split("image", 0, 2), "txt_ids": Split("text", 0, 2)}},
                      ("proj_out", Gather("image", 1, 3)))
"""Flux's own _cp_plan, for its descendants that declare none: packed image tokens and text split
at the model's inputs with their RoPE ids (so the rotary tables are computed per shard)."""
CONTROLNET = ("controlnet_block_samples", "controlnet_single_block_samples")
WAN_ATTENTION = {"blocks.*.attn1": IMAGE, "blocks.*.attn2": CROSS}
WAN_ROPE = {"rope:0": "image", "rope:1": "image"}
WAN_PLAN = ShardPlan({"rope": {0: Split("image", 1, 4), 1: Split("image", 1, 4)},
                      "blocks.0": {"hidden_states": Split("image", 1, 3)}}, ("proj_out", Gather("image", 1, 3)))
"""Wan's own _cp_plan (RoPE tables split, the video tokens split entering the first block), for its
descendants that declare none."""

COG_PLAN = ShardPlan({"transformer_blocks.0": {"hidden_states": Split("image", 1, 3),
                                               "encoder_hidden_states": Split("text", 1, 3)},
                      "transformer_blocks.*": {"image_rotary_emb": Split("image", 0, 2)}},
                     ("proj_out", Gather("image", 1, 3)))

FAMILIES: dict[str, Family] = {
    # MMDiT, text + image: joint attention in the double-stream blocks, then one stream over both
    "FluxTransformer2DModel": Family(attention=FLUX_ATTENTION, refuse_inputs=CONTROLNET),
    "BriaTransformer2DModel": Family(attention=FLUX_ATTENTION, plan=FLUX_PLAN, refuse_inputs=CONTROLNET),
    # its attention_mask covers text and image together (an outer product per query): not a key mask
    "ChromaTransformer2DModel": Family(attention=FLUX_ATTENTION, plan=FLUX_PLAN,
                                       refuse_inputs=(*CONTROLNET, "attention_mask")),
    "LongCatImageTransformer2DModel": Family(attention=FLUX_ATTENTION, plan=FLUX_PLAN),
    "OvisImageTransformer2DModel": Family(attention=FLUX_ATTENTION, plan=FLUX_PLAN),
    "Flux2Transformer2DModel": Family(attention=FLUX_ATTENTION, refuse_inputs=("kv_cache",)),
    # double-stream blocks over text + image, the text mask split with the text and per-token
    # modulation indices with the image
    "QwenImageTransformer2DModel": Family(
        attention={"transformer_blocks.*.attn": JOINT}, labels={"pos_embed:0": "image", "pos_embed:1": "text",
                                                               "modulate_index": "image"},
        refuse_inputs=("controlnet_block_samples",)),
    # MMDiT without a _cp_plan: split after the patch embedding (its positions added whole), gathered
    # before unpatchify; SD3.5's dual-attention blocks add self-attention over the image (attn2)
    "SD3Transformer2DModel": Family(
        attention={"transformer_blocks.*.attn": JOINT, "transformer_blocks.*.attn2": IMAGE},
        plan=ShardPlan({"": {"encoder_hidden_states": Split("text", 1, 3)}, "pos_embed": {0: Split("image", 1, 3)}},
                       ("proj_out", Gather("image", 1, 3))),
        output="patches2d", refuse_inputs=("block_controlnet_hidden_states",)),
    # self-attention over the video tokens, cross-attention to the text (and image) embeddings whole
    "WanTransformer3DModel": Family(attention=WAN_ATTENTION, labels=WAN_ROPE, output="patches3d"),
    "ChronoEditTransformer3DModel": Family(attention=WAN_ATTENTION, labels=WAN_ROPE, output="patches3d"),
    "SkyReelsV2Transformer3DModel": Family(
        attention=WAN_ATTENTION, plan=WAN_PLAN, output="patches3d", refuse_inputs=("enable_diffusion_forcing",),
        requires={"num_frame_per_block": (1, "frames attend block-causally through an S x S mask")}),
    # VACE: control blocks over the same video tokens (the whole hidden states enter each one), whose
    # hints the main blocks add
    "WanVACETransformer3DModel": Family(
        attention={**WAN_ATTENTION, "vace_blocks.*.attn1": IMAGE, "vace_blocks.*.attn2": CROSS},
        plan=ShardPlan({**WAN_PLAN.splits, "vace_blocks.*": {"hidden_states": Split("image", 1, 3)},
                        "vace_blocks.0": {"control_hidden_states": Split("image", 1, 3)}}, WAN_PLAN.exit),
        output="patches3d"),
    # MMDiT with register tokens prepended to the text: the text is split after them
    "AuraFlowTransformer2DModel": Family(
        attention={"joint_transformer_blocks.*.attn": JOINT, "single_transformer_blocks.*.attn": JOINT},
        plan=ShardPlan({"pos_embed": {0: Split("image", 1, 3)},
                        "joint_transformer_blocks.0": {"encoder_hidden_states": Split("text", 1, 3)}},
                       ("proj_out", Gather("image", 1, 3))), output="patches2d"),
    # DiT / PixArt: self-attention over the image, PixArt's cross-attention to the text whole; an
    # image attention_mask would describe the whole sequence at every rank
    "PixArtTransformer2DModel": Family(
        attention={"transformer_blocks.*.attn1": IMAGE, "transformer_blocks.*.attn2": CROSS},
        plan=ShardPlan({"pos_embed": {0: Split("image", 1, 3)}}, ("proj_out", Gather("image", 1, 3))),
        output="patches2d", refuse_inputs=("attention_mask",)),
    # CogVideoX / CogView: text and image embedded together (positions over both), then split as the
    # blocks receive them; joint attention over both, RoPE on the image part
    "CogVideoXTransformer3DModel": Family(
        attention={"transformer_blocks.*.attn1": JOINT}, plan=COG_PLAN, output="frames_cpq"),
    "CogView3PlusTransformer2DModel": Family(
        attention={"transformer_blocks.*.attn1": JOINT}, plan=COG_PLAN, output="patches2d_cpq"),
    # its text mask becomes a mask per query over text + image (an outer product): refused
    "CogView4Transformer2DModel": Family(
        attention={"transformer_blocks.*.attn1": JOINT},
        plan=ShardPlan({"patch_embed": {0: Split("image", 1, 3), 1: Split("text", 1, 3)},
                        "rope": {0: Split("image", 0, 2), 1: Split("image", 0, 2)}},
                       ("proj_out", Gather("image", 1, 3))),
        output="patches2d_cpq", refuse_inputs=("attention_mask",)),
    # LTX-Video: its _cp_plan also splits the text, which its cross-attention then all-to-alls with the
    # queries; seqpar keeps the text whole (no text K/V exchanged), so it runs a plan of its own: the
    # packed video tokens, their RoPE and per-token timesteps split
    "LTXVideoTransformer3DModel": Family(
        attention={"transformer_blocks.*.attn1": IMAGE, "transformer_blocks.*.attn2": CROSS},
        plan=ShardPlan({"": {"hidden_states": Split("image", 1, 3), "timestep": Split("image", 1, 2)},
                        "rope": {0: Split("image", 1, 3), 1: Split("image", 1, 3)}},
                       ("proj_out", Gather("image", 1, 3)))),
    # Cosmos: the video tokens split entering the blocks, with their RoPE table, learnable positions
    # and (per-frame timesteps) per-token modulation; the text mask serves the cross-attention whole
    "CosmosTransformer3DModel": Family(
        attention={"transformer_blocks.*.attn1": IMAGE, "transformer_blocks.*.attn2": CROSS},
        plan=ShardPlan({"rope": {0: Split("image", 0, 2), 1: Split("image", 0, 2)},
                        "learnable_pos_embed": {0: Split("image", 1, 3)},
                        "transformer_blocks.0": {"hidden_states": Split("image", 1, 3)},
                        "transformer_blocks.*": {"embedded_timestep": Split("image", 1, 3),
                                                 "temb": Split("image", 1, 3)},
                        "norm_out": {"embedded_timestep": Split("image", 1, 3), "temb": Split("image", 1, 3)}},
                       ("proj_out", Gather("image", 1, 3))),
        output="cosmos", refuse_inputs=("block_controlnet_hidden_states",)),
    "DiTTransformer2DModel": Family(
        attention={"transformer_blocks.*.attn1": IMAGE},
        plan=ShardPlan({"pos_embed": {0: Split("image", 1, 3)}}, ("proj_out_2", Gather("image", 1, 3))),
        output="patches2d"),
}
"""The classes seqpar runs exactly, by class name."""


"""The classes seqpar refuses, by class name, with the reason."""


def family_of(model: nn.Module) -> Family:
    """``model``'s :class:`Family`. Raises Refused (the same on every rank) for a refused class or
    one seqpar does not know, naming the class and the reason."""
    name = type(model).__name__
    if name in REFUSED:
        raise Refused(f"seqpar does not parallelize {name}: {REFUSED[name]}")
    family = FAMILIES.get(name)
    if family is None:
        raise Refused(f"seqpar does not parallelize {name}: it is not a diffusers transformer class seqpar knows "
                      f"(diffusers {_version()}); see docs/guides/diffusers.md for the classes it runs")
    family.check_config(model)
    return family


def _version() -> str:
    import diffusers

    return diffusers.__version__
