"""The two registries of the package: token-mixer families (by the class names they handle) and run
modes (by name). A family declares its rule -- which classes, which run modes in order of preference
-- and implements what those modes ask of it; a run mode says when it fits and how it runs. Neither
knows the other's list: a new family is one module that calls :func:`register_family`, a new run
mode one module that calls :func:`register_mode`::

    family_of(module)          type(module).__name__ -> its MixerFamily (None: not a mixer seqpar handles)
    family.modes               ("state", "heads", "gather"): the modes that can run it, in order of
                               preference (:mod:`.choice` picks among those that fit)
    family.state               StateKernels: the kernel functions "state" swaps (None: no such mode)
    mode_named("heads")        the RunMode: fits(family, module, batch), run(family, module, x, batch, group)

Classes are matched by exact name, never by a parent class: each one was read (its ``forward``
signature, causality, what its kernels take), and a subclass may compute something else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist
from torch import Tensor, nn

from ...batch.local_batch import LocalBatch

if TYPE_CHECKING:
    from .state_scans import StateScan

GATHER, HALO, HEADS, STATE = "gather", "halo", "heads", "state"
"""The run modes of :mod:`.modes` and :mod:`.state_passing` by name (a family lists them in
:attr:`MixerFamily.modes`)."""


@dataclass(frozen=True)
class StateKernels:
    """What the ``"state"`` run mode needs of a family: the module-level names of the kernel
    functions its classes' ``forward`` calls (:mod:`seqpar.compat`) -- the causal convolution, the chunked
    scan, and fused shortcuts that would bypass both (answered "none here") -- and how to run its
    scan from a state (:mod:`.state_scans`)."""

    scan: str
    kind: StateScan
    conv: str = "causal_conv1d_fn"
    fused: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every module global state passing swaps: the convolution, the scan, the fused shortcuts."""
        return (self.conv, self.scan, *self.fused)


@dataclass(frozen=True)
class MixerFamily:
    """A kind of token mixer and seqpar's rule for it: the transformers classes it covers (each
    read: ``forward(hidden_states, cache=None, attention_mask=None, **kwargs)``, causal, batch rows
    independent, ``kwargs`` only packing metadata or kernels) and the run modes that make it exact,
    in order of preference; the last one must always fit (``"gather"``). A family that lists a mode
    implements what that mode's module asks of it (e.g. ``"heads"``: ``units``, ``split_fits``,
    ``part``; ``"halo"``: ``halo_width``; ``"state"``: ``state``). ``name`` is what messages call it."""

    name: str
    classes: tuple[str, ...]
    modes: tuple[str, ...] = (GATHER,)
    state: StateKernels | None = None


class RunMode(Protocol):
    """How a handled token mixer runs on ``x [B, S/P, D]`` (this rank's shard) to give exactly its
    unsharded output's shard ``[B, S/P, D']``."""

    name: str
    description: str  # in words, for describe_token_mixers

    def fits(self, family: MixerFamily, module: nn.Module, batch: LocalBatch) -> bool: ...

    def run(self, family: MixerFamily, module: nn.Module, x: Tensor, batch: LocalBatch,
            group: dist.ProcessGroup) -> Tensor: ...


_FAMILIES: dict[str, MixerFamily] = {}
_MODES: dict[str, RunMode] = {}

HANDLED_MIXERS: Mapping[str, MixerFamily] = MappingProxyType(_FAMILIES)
"""Token-mixer class name -> the family seqpar runs it as (read-only; families register themselves)."""


def register_family(family: MixerFamily) -> MixerFamily:
    """Add ``family`` under each of its class names (a class belongs to one family)."""
    assert family.modes and family.modes[-1] == GATHER, f"{family.name}: the last run mode must be {GATHER!r}"
    assert (STATE in family.modes) == (family.state is not None), f"{family.name}: {STATE!r} needs its kernels"
    for cls in family.classes:
        assert cls not in _FAMILIES, f"{cls} is already handled by {_FAMILIES[cls].name}"
        _FAMILIES[cls] = family
    return family


def register_mode(mode: RunMode) -> RunMode:
    """Add a run mode under its name."""
    assert mode.name not in _MODES, f"run mode {mode.name!r} is already registered"
    _MODES[mode.name] = mode
    return mode


def family_of(module: nn.Module) -> MixerFamily | None:
    """The family of a token mixer seqpar handles (:data:`HANDLED_MIXERS`), else None."""
    return _FAMILIES.get(type(module).__name__)


def mode_named(name: str) -> RunMode:
    """The registered run mode ``name``."""
    return _MODES[name]
