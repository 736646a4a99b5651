"""What seqpar did to a model, in one record, with the undo stack that takes it back.

:func:`seqpar.parallelize` and :func:`seqpar.reduce_memory` each fill their part of the model's
:class:`ModelState` and push one undo step per change they make (an attention implementation set, a
loss function replaced, a hook registered, a module's ``forward`` replaced)::

    model._seqpar: ModelState
      parallel  ParallelState       what parallelize chose (strategy, kernel, the registered name)
      memory    MemoryState         what reduce_memory switched on, and the running call's hidden state
      steps     [Step, ...]         undo steps, oldest first, each tagged with its part

    unparallelize(model)   -> undo(model)            every step, newest first (reduce_memory's too)
    restore_memory(model)  -> undo(model, "memory")  reduce_memory's steps only, newest first

The record is one attribute on the model rather than an entry in a ``WeakKeyDictionary`` keyed by
it: a deep copy of a parallelized model (an EMA or DPO reference model) must carry its own record, so
that it runs, describes and undoes its *own* modules. ``copy.deepcopy`` copies the attribute with the
model; a side table would leave the copy without one. For the same reason an undo step must be
deep-copyable with the model -- a bound method, a ``functools.partial`` or a callable object over
what it undoes, never a closure (``deepcopy`` shares a closure, which would undo the original).
"""

from __future__ import annotations

import collections
import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..attention.kernels import KernelArg
from .peft import unwrap_peft

PARTS = ("parallel", "memory")
_ATTR = "_seqpar"  # the one attribute seqpar sets on a model



class TileContext:
    """The longest local shard of the batch running now (None: not sequence-parallel, tile the local
    length), shared by a model's tiled MLPs; a checkpointed layer restores it for its recompute."""

    def __init__(self) -> None:
        self.longest: int | None = None
        self.tiles_run: collections.deque[int] = collections.deque(maxlen=256)  # latest tile counts (for tests)

    @contextlib.contextmanager
    def using(self, longest: int | None) -> Iterator[None]:
        saved, self.longest = self.longest, longest
        try:
            yield
        finally:
            self.longest = saved


@dataclass
class ParallelState:
    """What :func:`seqpar.parallelize` did: the attention name it registered, the implementation it
    replaced (restored by its undo steps), the strategy and kernel it runs."""

    name: str
    original: str | None
    sub_config: str | None  # None: the top-level config; else e.g. "text_config"
    strategy: str
    kernel: KernelArg | None
    num_heads: int
    num_kv_heads: int
    tp: int = 1  # tensor-parallel degree (> 1: the weights are split, and cannot be put back)


@dataclass
class MemoryState:
    """What :func:`seqpar.reduce_memory` switched on, and what its hooks share during a call."""

    tiled_loss: bool
    tiled_mlp: bool
    checkpoint: str
    loss_tile: int
    mlp_tile: int | None  # None: each call's tile follows its shard (seqpar.batch.tiles.mlp_tile_for)
    mesh: DeviceMesh | None
    context: TileContext  # the running batch's longest shard, shared by the tiled MLPs and checkpoints
    mlps: list[nn.Module]
    layers: list[nn.Module]
    offload: str  # what checkpoint="offload" does on this device, in words
    hidden: Tensor | None = None  # the decoder's last hidden state of the running call
    catch: bool = False  # whether the running call computes a loss (only then is the hidden state kept)
    head_checked: bool = False


@dataclass
class Step:
    """One undo step: ``undo()`` reverts one change ``part`` made (``what``, in words)."""

    part: str
    what: str
    undo: Callable[[], Any]


@dataclass
class ModelState:
    """The record on a model: each part's state (None: that part is off) and the undo steps of all
    parts, oldest first. Changed only through :meth:`push` and :func:`undo`."""

    parallel: ParallelState | None = None
    memory: MemoryState | None = None
    steps: list[Step] = field(default_factory=list)

    def push(self, part: str, what: str, undo: Callable[[], Any]) -> None:
        """Record how to revert a change ``part`` just made."""
        assert part in PARTS, part
        # a closure would be shared by a deep copy of the model and undo the original's modules
        assert not (isinstance(undo, types.FunctionType) and undo.__closure__), \
            f"undo step {what!r} is a closure: use a bound method, functools.partial or a callable object"
        self.steps.append(Step(part, what, undo))

    def pending(self, part: str | None = None) -> list[str]:
        """The undo steps of ``part`` (every part's with None), in words, oldest first."""
        return [f"{s.part}: {s.what}" for s in self.steps if part is None or s.part == part]


def state_of(model: nn.Module) -> ModelState | None:
    """The record of what seqpar did to ``model``, or None if it did nothing (or undid it all). A
    peft ``PeftModel``'s record is its base model's (the model seqpar changed)."""
    state = unwrap_peft(model).__dict__.get(_ATTR)
    return state if isinstance(state, ModelState) else None


def ensure_state(model: nn.Module) -> ModelState:
    """``model``'s record, attached now if it has none."""
    state = state_of(model)
    if state is None:
        state = ModelState()
        unwrap_peft(model).__dict__[_ATTR] = state  # plain attribute: not a parameter, buffer or submodule
    return state


def set_loss_function(model: nn.Module, fn: Any) -> None:
    """``model.loss_function = fn``, as an undo step (``functools.partial(set_loss_function, model, old)``)."""
    model.loss_function = fn


def undo(model: nn.Module, part: str | None = None) -> None:
    """Revert what ``part`` did to ``model`` (every part with None): its undo steps popped newest
    first, then the part forgotten; the record goes when nothing is left in it. A step that raises
    leaves the older ones on the stack (a second call retries them)."""
    state = state_of(model)
    if state is None:
        return
    while True:
        i = next((i for i in range(len(state.steps) - 1, -1, -1)
                  if part is None or state.steps[i].part == part), None)
        if i is None:
            break
        state.steps.pop(i).undo()
    for name in PARTS if part is None else (part,):
        setattr(state, name, None)
    if not state.steps and all(getattr(state, name) is None for name in PARTS):
        del unwrap_peft(model).__dict__[_ATTR]
