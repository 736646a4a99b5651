"""A collective call that a failure on one rank cannot hang: its local compute runs under a Guard.

Without it, a rank whose kernel raises (out of memory, a bad shape deep in a kernel) leaves the
call, and its peers wait in the call's next collective until the process-group timeout. Under a
:class:`Guard` the failing rank keeps the call's communication pattern going with placeholders,
and at the end of the call every rank meets in one :func:`seqpar.comm.agree.fence`, which raises
on every rank together::

    rank 0:  a2a -> kernel ok    -> a2a -> fence --> RuntimeError "rank 1: OutOfMemoryError: ..."
    rank 1:  a2a -> kernel raises -> a2a -> fence --> OutOfMemoryError (same text), chained
                    (kept; zeros sent on)

The backward gets the same: the kernel backward runs under the guard, and :meth:`Guard.inputs`
puts a fence at the inputs of the call, whose backward runs once every other backward step of
the call (collectives included) is done. Cost: one tiny all-gather per call and direction (one
per group stage), plus the host sync of reading it -- or nothing of its own where the call's last
all-to-all of a direction carries every rank's failure flag (:meth:`Guard.flag`, one group): the
fence then gathers only when some rank failed::

    rank 0:  a2a -> kernel ok     -> a2a + flag 0 -> flags [0, 1]: fence --> RuntimeError "rank 1: ..."
    rank 1:  a2a -> kernel raises -> a2a + flag 1 -> flags [0, 1]: fence --> OutOfMemoryError, chained
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from .agree import fence

T = TypeVar("T")


class Guard:
    """This rank's first failure in the local compute of one collective call, kept until the call's
    fence. ``groups``: the fence stages (:func:`seqpar.comm.agree.fence`); ``what`` names the call."""

    def __init__(self, groups: Sequence[dist.ProcessGroup], what: str) -> None:
        self.groups, self.what = list(groups), what
        self.error: Exception | None = None
        self._heard: dict[str, bool] = {}  # direction -> did any rank's flag say it failed

    @property
    def failed(self) -> bool:
        return self.error is not None

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)``; None when it raised (the error is kept) or an earlier call did."""
        if self.error is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # kept, and raised on every rank by the fence
            self.error = e
            return None

    def flag(self, direction: str) -> _FailureFlag:
        """This rank's failure, as a :class:`~seqpar.comm.collectives.Flag` for the last all-to-all of
        ``direction`` (``"forward"`` or ``"backward"``) over this guard's one group. Nothing guarded
        may run after that exchange in that direction: the fence trusts the flags it heard."""
        if len(self.groups) != 1:
            raise ValueError(f"{self.what}: a failure flag needs a guard of one group, this one has {len(self.groups)}")
        return _FailureFlag(self, direction)

    def fence(self, direction: str) -> None:
        """Every rank of the call raises if any rank failed (see :func:`seqpar.comm.agree.fence`).
        Free when a flag of ``direction`` told every rank that none did: they all heard the same."""
        error, self.error = self.error, None
        heard = self._heard.pop(direction, None)
        if heard is False:  # every rank heard every flag: none failed, so none enters a fence
            if error is not None:  # a guarded call after the flagged exchange: a bug in the caller
                raise RuntimeError(f"seqpar: {self.what} ({direction}) failed after its failure flag was sent"
                                   ) from error
            return
        fence(self.groups, error, what=f"{self.what} ({direction})")

    def inputs(self, *xs: Tensor | None) -> tuple[Tensor | None, ...]:
        """The call's inputs, unchanged; their backward holds the fence of the call's backward."""
        present = [x for x in xs if x is not None]
        if not present:
            return xs
        out = iter(_FenceInBackward.apply(self, *present))
        return tuple(None if x is None else next(out) for x in xs)


class _FailureFlag:
    """A guard's failure (1) or not (0), riding an all-to-all of one direction; what every rank
    sent is kept for the guard's fence of that direction."""

    def __init__(self, guard: Guard, direction: str) -> None:
        self.guard, self.direction = guard, direction

    def value(self) -> float:
        return float(self.guard.failed)

    def receive(self, values: list[float]) -> None:
        self.guard._heard[self.direction] = any(values)


def guarded(guard: Guard | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """``guard.call(fn, ...)``, or a plain call (errors propagate) without a guard."""
    return fn(*args, **kwargs) if guard is None else guard.call(fn, *args, **kwargs)


class _FenceInBackward(torch.autograd.Function):
    """Forward: identity. Backward: the guard's fence, then identity. Every other backward step of
    the call feeds into this one (its outputs are the call's inputs), so when it runs, a rank whose
    backward failed has already done its part of the call's communication."""

    @staticmethod
    def forward(ctx, guard: Guard, *xs: Tensor) -> tuple[Tensor, ...]:
        ctx.guard = guard
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        ctx.guard.fence("backward")
        return (None, *grads)
