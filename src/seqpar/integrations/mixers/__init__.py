"""Token mixers that are not attention -- state-space (Mamba, Mamba2), linear-attention (Gated
DeltaNet, Kimi delta attention) and short-convolution (LFM2) layers of hybrid models -- made exact
under sequence parallelism, and the ones seqpar refuses. The package::

    registry.py        MixerFamily (a family's rule: classes, run modes, state kernels), RunMode, the registries
    modes.py           the run modes gather, heads, halo (and the rows / packed documents they run)
    state_passing.py   the run mode state: each rank its own tokens, the scan's state across ranks
    pieces.py          a batch's shards as runs of the original order per document (state passing's unit)
    state_scans.py     how state passing runs each scan: delta rules, Mamba2's SSD, Mamba's S6
    choice.py          state or heads: both measured once per mixer class, P and dtype, the faster kept
    views.py           module copies whose weights are views of the real ones (public APIs only)
    gated_deltanet.py  Qwen3-Next / Qwen3.5 / OLMo hybrid: state passing; Qwen3-Next / 3.5 split by key heads too
    kimi.py            Kimi delta attention, Bailing hybrid: state passing; Kimi's split by heads too
    mamba2.py          Bamba, NemotronH, Zamba2, Granite hybrid, Falcon-H1: state passing; all but Falcon-H1
                       split by groups or heads too (the group's norm across ranks)
    mamba.py           Jamba's and Zamba's Mamba: state passing; Jamba's split by inner channels too
    short_conv.py      LFM2's short convolution: halo
    wrap.py            wrap_token_mixers (returns the undo), set_mixer_mode, describe_token_mixers
    availability.py    mode_gaps / warn_mode_gaps: a preferred mode the installed transformers does not allow
    refusals.py        what parallelize refuses: unknown token mixers, positions it cannot feed

A new family is one module that registers a :class:`MixerFamily` naming the classes it handles and
its run modes; a new run mode is one module that registers a :class:`RunMode` (imported below).
"""

from . import gated_deltanet, kimi, mamba, mamba2, modes, short_conv, state_passing  # noqa: F401  (they register themselves)
from .availability import mode_gaps, warn_mode_gaps
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
    "mode_gaps",
    "mode_named",
    "run_token_mixer",
    "set_mixer_mode",
    "token_mixers",
    "unsupported_mixers",
    "warn_mode_gaps",
    "wrap_token_mixers",
]
