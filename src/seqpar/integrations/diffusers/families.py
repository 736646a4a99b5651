"""Which diffusers transformer classes seqpar runs, and how: one :class:`Family` declaration per class,
or the reason it is refused (:data:`REFUSED`). Declared, never guessed from the model's structure:
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

from torch import nn

from ...errors import Refused
from .plan import Gather, ShardPlan, Split, from_cp_plan

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
    ``refuse_inputs``: forward inputs that would enter the sharded region whole (ControlNet residuals,
    IP-adapter embeddings): refused when given.
    """

    attention: Mapping[str, tuple[str, ...] | None]
    plan: ShardPlan | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    output: str = "tokens"
    refuse_inputs: tuple[str, ...] = ()

    def shard_plan(self, model: nn.Module) -> ShardPlan:
        """The plan for ``model``: the declared one, or its ``_cp_plan`` labelled."""
        if self.plan is not None:
            return self.plan
        return from_cp_plan(model, self.labels)


FAMILIES: dict[str, Family] = {
    # MMDiT, text + image: joint attention in the double-stream blocks, then one stream over both
    "FluxTransformer2DModel": Family(
        attention={"transformer_blocks.*.attn": JOINT, "single_transformer_blocks.*.attn": JOINT},
        refuse_inputs=("controlnet_block_samples", "controlnet_single_block_samples")),
    # MMDiT without a _cp_plan: split after the patch embedding (its positions added whole), gathered
    # before unpatchify; SD3.5's dual-attention blocks add self-attention over the image (attn2)
    "SD3Transformer2DModel": Family(
        attention={"transformer_blocks.*.attn": JOINT, "transformer_blocks.*.attn2": IMAGE},
        plan=ShardPlan({"": {"encoder_hidden_states": Split("text", 1, 3)}, "pos_embed": {0: Split("image", 1, 3)}},
                       ("proj_out", Gather("image", 1, 3))),
        output="patches2d", refuse_inputs=("block_controlnet_hidden_states",)),
    # self-attention over the video tokens, cross-attention to the text (and image) embeddings whole
    "WanTransformer3DModel": Family(
        attention={"blocks.*.attn1": IMAGE, "blocks.*.attn2": CROSS},
        labels={"rope:0": "image", "rope:1": "image"}, output="patches3d"),
}
"""The classes seqpar runs exactly, by class name."""

REFUSED: dict[str, str] = {}
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
    return family


def _version() -> str:
    import diffusers

    return diffusers.__version__
