"""A parallelized model's forward tells every rank of an exception it raises (:mod:`seqpar.comm.faults`).

The model's own code (transformers raising on one rank's images, an out-of-memory error in one rank's
MLP, the loss) would otherwise leave the other ranks waiting in their next collective. So
:func:`seqpar.parallelize` replaces the model's ``forward`` (an instance attribute, as
``reduce_memory`` does for layers; an undo step of the model's record puts the old one back) by one
that publishes an exception on its way out -- once, where it is raised -- and turns a transport error
caused by another rank's fault into that fault's RankFailed. The steady-state cost is one
``try`` around the call.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

from torch import nn

from ..comm import faults
from .state import ModelState, state_of


def _publishing_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    record = state_of(self)
    inner = record.parallel.inner_forward if record is not None and record.parallel is not None else None
    try:
        return inner(*args, **kwargs) if inner is not None else type(self).forward(self, *args, **kwargs)
    except Exception as e:
        faults.stop(e, "the forward")  # raises RankFailed when e is another rank's fault coming through
        raise


def publish_forward_errors(model: nn.Module, record: ModelState) -> None:
    """Make ``model``'s forward publish its exceptions (see the module doc); pushes its undo step.
    ``record.parallel`` must be set: it keeps an instance forward that was there before."""
    assert record.parallel is not None
    record.parallel.inner_forward = model.__dict__.get("forward")
    # the signature of the forward it wraps: code that inspects ``model.forward`` (transformers'
    # ``logits_to_keep`` check, Trainer's column pruning) sees the model's own parameters
    shown = inspect.signature(model.forward)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)

    @functools.wraps(_publishing_forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _publishing_forward(self, *args, **kwargs)

    forward.__signature__ = shown.replace(parameters=[self_param, *shown.parameters.values()])  # type: ignore[attr-defined]
    # a bound method: a deep copy of the model (an EMA, a DPO reference) gets one bound to itself
    model.forward = types.MethodType(forward, model)
    record.push("parallel", "the forward that tells every rank of an exception",
                functools.partial(_restore_forward, model, record.parallel.inner_forward))


def _restore_forward(model: nn.Module, previous: Any) -> None:
    if previous is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = previous
