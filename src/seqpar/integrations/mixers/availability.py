"""Which run modes the installed transformers leaves a model's token mixers: state passing reaches
into each class's modeling module (:mod:`seqpar.compat`), and a release that moves a kernel makes
it unavailable there -- never wrong: the mixer then runs in its next mode, exact but without the
memory state passing saves. :func:`mode_gaps` says so per class, in words; ``parallelize`` gives
them as one :class:`~seqpar.errors.FeatureUnavailable` warning on rank 0 (:func:`warn_mode_gaps`)::

    state passing unavailable on transformers 5.26.0: Qwen3NextGatedDeltaNet runs split by heads
    (each rank the whole sequence for its heads); memory per rank does not divide by P (why: ...)
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch import nn

from ...errors import FeatureUnavailable
from .registry import GATHER, HEADS, STATE, MixerFamily, family_of
from .state_passing import state_unavailable


def _version() -> str:
    import transformers

    return transformers.__version__


def _fallback(family: MixerFamily, module: nn.Module, p: int) -> str:
    """What ``module`` runs as without state passing at SP size ``p``, and what that costs."""
    if HEADS in family.modes and family.split_fits(module, p):
        return ("runs split by heads (each rank the whole sequence for its share of the heads); memory per rank "
                "does not divide by P")
    assert family.modes[-1] == GATHER
    return "runs gathered (each rank the whole sequence); compute and memory per rank do not divide by P"


def mode_gaps(model: nn.Module, p: int) -> list[str]:
    """One line per handled token-mixer class of ``model`` whose family prefers state passing and
    cannot run it here (:func:`.state_passing.state_unavailable`), at SP size ``p``; [] when none."""
    seen: dict[str, str] = {}
    for _, module in model.named_modules():
        family, name = family_of(module), type(module).__name__
        if family is None or STATE not in family.modes or name in seen:
            continue
        why = state_unavailable(family, module)
        if why is not None:
            seen[name] = (f"state passing unavailable on transformers {_version()}: {name} "
                          f"{_fallback(family, module, p)} (why: {why})")
    return list(seen.values())


def warn_mode_gaps(model: nn.Module, p: int) -> None:
    """:func:`mode_gaps` as one :class:`~seqpar.errors.FeatureUnavailable` warning, on rank 0 only
    (every rank computes the same lines: each holds the same classes and versions)."""
    gaps = mode_gaps(model, p)
    if gaps and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn("; ".join(gaps), FeatureUnavailable, stacklevel=3)
