"""Making a model's handled token mixers sequence-parallel: an instance ``forward`` that shadows the
class's on each of them (the class's own code and kernels still do the work, through the run
modes of :mod:`.modes`), and the callable that takes it away again::

    wrap_token_mixers(model, mesh, batch_fn) -> undo      parallelize keeps undo, unparallelize calls it
      mixer(hidden_states)  # [B, S/P, D]                 checks the call, then
        run_token_mixer       the first run mode of the family's list that fits   # [B, S/P, D']
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...batch.sharding import BATCH_KWARG, LocalBatch
from ...comm.mesh import Axis, axis_group
from .registry import family_of, mode_named


def token_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every handled token mixer in ``model``."""
    return [(n, m) for n, m in model.named_modules() if family_of(m) is not None]


def describe_token_mixers(model: nn.Module) -> str:
    """In words: which non-attention token mixers ``model`` has and how seqpar runs them (its
    family's preferred run mode; "" if none)."""
    counts: dict[tuple[str, str], int] = {}
    for _, m in token_mixers(model):
        key = (type(m).__name__, family_of(m).modes[0])
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{n} x{c} {mode_named(mode).description}" for (n, mode), c in sorted(counts.items()))


def run_token_mixer(module: nn.Module, hidden_states: Tensor, batch: LocalBatch, group: dist.ProcessGroup, *,
                    mode: str | None = None) -> Tensor:
    """A handled token mixer on this rank's shard ``hidden_states [B, S/P, D]`` -> its exact
    unsharded output's shard ``[B, S/P, D']``, in the first of its family's run modes that fits
    (or in ``mode``: one of the family's, for benchmarks that compare them)."""
    family = family_of(module)
    assert family is not None, f"{type(module).__name__} is not a token mixer seqpar handles"
    if mode is None:
        mode = next(m for m in family.modes if mode_named(m).fits(family, module, batch))
    assert mode in family.modes and mode_named(mode).fits(family, module, batch), \
        f"{family.name} does not run in mode {mode!r} here (its modes: {family.modes})"
    return mode_named(mode).run(family, module, hidden_states, batch, group)


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
    ``"sp"`` axis of ``mesh`` (in place). ``last_batch`` returns the LocalBatch of the model's
    current call (caught by parallelize's pre-hook). Returns the undo: call it to restore the
    modules (nothing to undo when the model has no handled mixer)."""
    group = axis_group(mesh, Axis.SP.value)
    forward = _sequence_parallel_forward(group, last_batch)
    wrapped = []
    for _, module in token_mixers(model):
        # a bound method: a deep copy of the model (an EMA or reference model) binds its own module
        module.forward = types.MethodType(forward, module)
        wrapped.append(module)
    return _Unwrap(wrapped)


def _sequence_parallel_forward(group: dist.ProcessGroup,
                               last_batch: Callable[[], LocalBatch | None]) -> Callable[..., Tensor]:
    """The ``forward`` seqpar binds to a handled token mixer: checks the call, then
    :func:`run_token_mixer`."""

    def forward(module: nn.Module, hidden_states: Tensor, cache: Any = None, attention_mask: Tensor | None = None,
                **kwargs: Any) -> Tensor:
        # hidden_states [B, S/P, D]: this rank's shard
        batch = kwargs.get(BATCH_KWARG) or last_batch()
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
        batch.attention_calls += 1  # a layer that read the batch (the loss checks that some did)
        return run_token_mixer(module, hidden_states, batch, group)

    return forward
