"""A parallelized model's forward tells every rank of an exception it raises (:mod:`seqpar.comm.faults`).

The model's own code (transformers raising on one rank's images, an out-of-memory error in one rank's
MLP, the loss) would otherwise leave the other ranks waiting in their next collective. So
:func:`seqpar.parallelize` registers a forward hook with ``always_call=True`` on the model -- torch
runs it on the way out of a forward that raised, inside its ``except``, so the hook reads the
exception from ``sys.exc_info()`` -- that publishes the exception, once, where it is raised (an undo
step of the model's record removes the hook). A forward that returns calls it with its output:
nothing to do. The steady-state cost is one hook call per forward of the whole model.

torch silences an exception raised by such a hook (the forward's own error goes on), so the hook
never raises: a transport error caused by another rank's fault is turned into that fault's
RankFailed where seqpar waits (:mod:`seqpar.comm.waits`), not here.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from ...comm import faults
from ..state import ModelState


def _publish_failure(_module: nn.Module, _args: Any, output: Any) -> None:
    if output is not None:  # the forward returned
        return
    error = sys.exc_info()[1]
    if isinstance(error, Exception):
        faults.note(error, "the forward")


def publish_forward_errors(model: nn.Module, record: ModelState) -> None:
    """Make ``model``'s forward publish its exceptions (see the module doc); pushes its undo step."""
    handle = model.register_forward_hook(_publish_failure, always_call=True)
    record.push("parallel", "the forward hook that tells every rank of an exception", handle.remove)
