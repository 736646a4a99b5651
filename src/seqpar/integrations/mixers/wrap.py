"""Making a model's handled token mixers sequence-parallel: an instance ``forward`` that shadows the
class's on each of them (the class's own code and kernels still do the work, through the run
modes of :mod:`.modes` and :mod:`.state_passing`), and the callable that takes it away again::

    wrap_token_mixers(model, mesh, batch_fn) -> undo      parallelize keeps undo, unparallelize calls it
      mixer(hidden_states)  # [B, S/P, D]                 checks the call, then
        choose                the run mode (:mod:`.choice`), or the one set_mixer_mode forces
        run_token_mixer       that mode                                          # [B, S/P, D']
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...batch.local_batch import BATCH_KWARG, LocalBatch
from ...batch.loss import bin_group
from ...comm.mesh import Axis, axis_group
from .choice import Choice, choose
from .registry import family_of, mode_named


def token_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every handled token mixer in ``model``."""
    return [(n, m) for n, m in model.named_modules() if family_of(m) is not None]


def describe_token_mixers(model: nn.Module) -> str:
    """In words: which non-attention token mixers ``model`` has and how seqpar runs them -- the
    mode each class ran in at the model's last call and why, or before any call the modes its
    family lists; "" if none."""
    runs = _forwards(model)
    counts: dict[str, int] = {}
    for _, m in token_mixers(model):
        counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    out = []
    for name, n in sorted(counts.items()):
        family = next(family_of(m) for _, m in token_mixers(model) if type(m).__name__ == name)
        chosen = next((r.chosen[name] for r in runs if name in r.chosen), None)
        if chosen is not None:
            out.append(f"{name} x{n} {mode_named(chosen.mode).description} [{chosen.reason}]")
        else:
            out.append(f"{name} x{n}: not run yet; modes {', '.join(family.modes)} "
                       f"({mode_named(family.modes[0]).description} where it fits)")
    return "; ".join(out)


def chosen_modes(model: nn.Module) -> dict[str, str]:
    """Token-mixer class name -> the run mode its last call took, for the parallelized ``model``."""
    return {name: c.mode for run in _forwards(model) for name, c in run.chosen.items()}


def run_token_mixer(module: nn.Module, hidden_states: Tensor, batch: LocalBatch, group: dist.ProcessGroup, *,
                    mode: str | None = None) -> Tensor:
    """A handled token mixer on this rank's shard ``hidden_states [B, S/P, D]`` -> its exact
    unsharded output's shard ``[B, S/P, D']``, in the mode :func:`.choice.choose` picks (measuring
    afresh: a parallelized model keeps its decisions) or in ``mode`` (one of the family's that fits
    here, for benchmarks and tests that compare them)."""
    family = family_of(module)
    assert family is not None, f"{type(module).__name__} is not a token mixer seqpar handles"
    if mode is None:
        mode = choose(family, module, hidden_states, batch, group, {}).mode
    assert mode in family.modes and mode_named(mode).fits(family, module, batch), \
        f"{family.name} does not run in mode {mode!r} here (its modes: {family.modes})"
    return mode_named(mode).run(family, module, hidden_states, batch, group)


def set_mixer_mode(model: nn.Module, mode: str | None) -> None:
    """Run the handled token mixers of the parallelized ``model`` in ``mode`` (``"state"``,
    ``"heads"``, ``"halo"``, ``"gather"``) wherever their family lists it and it fits the batch
    (elsewhere, and with ``mode=None``, :mod:`.choice` decides). Raises ValueError if ``model``
    has no wrapped token mixer, or none of them lists ``mode``."""
    runs = _forwards(model)
    if not runs:
        raise ValueError("set_mixer_mode: the model has no token mixer seqpar wrapped (parallelize it first)")
    if mode is not None and not any(mode in family_of(m).modes for _, m in token_mixers(model)):
        raise ValueError(f"set_mixer_mode: no token mixer of this model runs in mode {mode!r}; its mixers' modes: "
                         f"{sorted({x for _, m in token_mixers(model) for x in family_of(m).modes})}")
    for run in runs:
        run.mode = mode


class _Unwrap:
    """The undo of :func:`wrap_token_mixers`: removes the instance ``forward`` of the modules it
    wrapped. An object rather than a closure, so that a deep copy of the model (holding it in
    parallelize's state) unwraps its own copies of the modules, not the original's."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules

    def __call__(self) -> None:
        for module in self.modules:
            if "forward" in vars(module):
                del module.forward
        self.modules = []


def wrap_token_mixers(model: nn.Module, mesh: DeviceMesh,
                      last_batch: Callable[[], LocalBatch | None]) -> Callable[[], None]:
    """Make every handled token mixer of ``model`` exact under sequence parallelism over the
    ``"sp"`` axis of ``mesh`` (in place), or over the block of ranks a dynamic schedule's bin was
    sharded over (:func:`seqpar.batch.loss.bin_group`). ``last_batch`` returns the LocalBatch of the
    model's current call (caught by parallelize's pre-hook). Returns the undo: call it to restore the
    modules (nothing to undo when the model has no handled mixer)."""
    forward = ParallelForward(mesh, last_batch)
    wrapped = []
    for _, module in token_mixers(model):
        # a bound method: a deep copy of the model (an EMA or reference model) binds its own module
        # and its own copy of the ParallelForward
        module.forward = types.MethodType(forward, module)
        wrapped.append(module)
    return _Unwrap(wrapped)


class ParallelForward:
    """The ``forward`` seqpar binds to the handled token mixers of one model: checks the call,
    picks the run mode (``mode`` when set_mixer_mode forced one and it fits, else
    :func:`.choice.choose`, whose measured decisions it keeps), runs it and keeps the choice per
    class (``chosen``)."""

    def __init__(self, mesh: DeviceMesh, last_batch: Callable[[], LocalBatch | None]) -> None:
        self.mesh, self.group, self.last_batch = mesh, axis_group(mesh, Axis.SP.value), last_batch
        self.mode: str | None = None
        self.chosen: dict[str, Choice] = {}
        self.measured: dict[tuple[object, ...], Choice] = {}  # choose()'s measured decisions, this model's

    def __deepcopy__(self, memo: dict[int, Any]) -> ParallelForward:
        """A deep copy of the model gets its own (same group, same batch source, its own choices)."""
        out = ParallelForward(self.mesh, self.last_batch)
        out.mode, out.measured = self.mode, dict(self.measured)
        return out

    def __call__(self, module: nn.Module, hidden_states: Tensor, cache: Any = None,
                 attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        # hidden_states [B, S/P, D]: this rank's shard
        batch = kwargs.get(BATCH_KWARG) or self.last_batch()
        if not isinstance(batch, LocalBatch):
            raise ValueError("this model is sequence-parallel (seqpar.parallelize): feed it "
                             "model(**seqpar.shard_batch(batch, mesh)), or call seqpar.unparallelize(model)")
        if cache is not None:
            raise ValueError(f"{type(module).__name__} got a cache: sequence-parallel training runs with "
                             "use_cache=False (as shard_batch sets it)")
        if hidden_states.shape[1] != batch.local_len:
            raise ValueError(f"the batch was sharded with {batch.local_len} tokens on this rank, but "
                             f"{type(module).__name__} runs over {hidden_states.shape[1]}: shard the batch with the "
                             "mesh the model was parallelized with")
        # a dynamic schedule's bin runs over the block of ranks it was sharded over (degree 1: this rank
        # alone, the whole sequence here -- nothing crosses ranks)
        group = bin_group(self.mesh, batch, self.group)
        batch.attention_calls += 1  # a layer that read the batch (the loss checks that some did)
        family = family_of(module)
        forced = self.mode
        if forced is not None and forced in family.modes and mode_named(forced).fits(family, module, batch):
            choice = Choice(forced, "set by set_mixer_mode")
        else:
            choice = choose(family, module, hidden_states, batch, group, self.measured)
        self.chosen[type(module).__name__] = choice
        return run_token_mixer(module, hidden_states, batch, group, mode=choice.mode)


def _forwards(model: nn.Module) -> list[ParallelForward]:
    """The ParallelForward objects bound to ``model``'s token mixers (one per wrap)."""
    out: list[ParallelForward] = []
    for _, m in token_mixers(model):
        bound = vars(m).get("forward")
        fn = getattr(bound, "__func__", None)
        if isinstance(fn, ParallelForward) and fn not in out:
            out.append(fn)
    return out
