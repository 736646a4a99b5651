"""Token mixers that are not attention -- state-space (Mamba, Mamba2), linear-attention (Gated
DeltaNet, Kimi delta attention) and short-convolution (LFM2) layers of hybrid models -- made exact
under sequence parallelism, and the ones seqpar refuses. The package::

    registry.py        MixerFamily (a family's rule: classes, run modes), RunMode, the two registries
    modes.py           the run modes: gather, heads, halo (and the rows / packed documents they run)
    views.py           module copies whose weights are views of the real ones (public APIs only)
    gated_deltanet.py  Qwen3-Next / Qwen3.5 split by key heads; OLMo hybrid gathered
    kimi.py            Kimi delta attention split by heads; Bailing hybrid gathered
    mamba2.py          Mamba2 split by groups or heads (the group's norm across ranks); Falcon-H1 gathered
    mamba.py           Jamba's Mamba split by inner channels (x_proj summed); Zamba's, Mamba gathered
    short_conv.py      LFM2's short convolution: halo
    wrap.py            wrap_token_mixers (returns the undo), run_token_mixer, describe_token_mixers
    refusals.py        what parallelize refuses: unknown token mixers, positions it cannot feed

A new family is one module that registers a :class:`MixerFamily` naming the classes it handles and
its run modes; a new run mode is one module that registers a :class:`RunMode` (imported below).
"""

from . import gated_deltanet, kimi, mamba, mamba2, modes, short_conv, state_passing  # noqa: F401  (they register themselves)
from .refusals import check_token_mixers, unsupported_mixers
from .registry import (
    GATHER,
    HALO,
    HANDLED_MIXERS,
    HEADS,
    STATE,
    MixerFamily,
    RunMode,
    StateKernels,
    family_of,
    mode_named,
)
from .wrap import chosen_modes, describe_token_mixers, run_token_mixer, set_mixer_mode, token_mixers, wrap_token_mixers

__all__ = [
    "GATHER",
    "HALO",
    "HANDLED_MIXERS",
    "HEADS",
    "MixerFamily",
    "RunMode",
    "STATE",
    "StateKernels",
    "check_token_mixers",
    "chosen_modes",
    "describe_token_mixers",
    "family_of",
    "mode_named",
    "run_token_mixer",
    "set_mixer_mode",
    "token_mixers",
    "unsupported_mixers",
    "wrap_token_mixers",
]
