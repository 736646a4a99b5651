"""A collective call that a failure on one rank cannot hang: its local compute runs under a Guard.

Without it, a rank whose kernel raises (out of memory, a bad shape deep in a kernel) leaves the
call, and its peers wait in the call's next collective until the process-group timeout. Under a
:class:`Guard` the failing rank keeps the call's communication pattern going with placeholders
(zeros), skips its own compute from then on, and every rank later meets in one
:func:`seqpar.comm.agree.fence`, which raises on every rank together, with the failing rank's
message. When that fence runs is the guard's mode.

**Checked per call** (a call without a batch's SeqShard, or one autograd will not differentiate):
the call ends with the fence in each direction (:meth:`Guard.inputs` puts the backward's at the
inputs, whose backward runs once every other backward step of the call is done)::

    rank 0:  a2a -> kernel ok    -> a2a -> fence --> RuntimeError "rank 1: OutOfMemoryError: ..."
    rank 1:  a2a -> kernel raises -> a2a -> fence --> OutOfMemoryError (same text), chained
                    (kept; zeros sent on)

Cost: one tiny all-gather per call and direction and reading it on the host -- or just the read
where the call's last all-to-all carries every rank's failure flag (:meth:`Guard.flag`).

**Checked once per batch** (a training step: a batch's SeqShard, autograd on). A host read per
layer would stall a GPU's queue, so the calls of one batch only note what failed (on the host:
this rank's own failure needs no device read) and the ranks agree once, at a point every rank
reaches before a result is used::

    layer:    1          2                3 ...   loss                       end of backward
    rank 0:   ok         ok (zeros in)    ok      all-reduce [loss, 0] ->    (fence again:
    rank 1:   ok         kernel raises    skip    all-reduce [loss, 1] ->     backward failures)
                                                  sum 1 > 0: fence, raise on every rank

* forward: seqpar's loss (:mod:`seqpar.batch.loss`) all-reduces ``[loss, failed]`` in one
  collective and reads it (:func:`pending_failure`, :func:`check_failures`); so does
  :func:`seqpar.gather_log_probs` -- a loss value is never returned from a failed forward;
* backward: the first deferred backward call queues :func:`check_failures` to run when autograd's
  backward pass ends (``queue_callback``, as FSDP and DDP do), before ``backward()`` returns -- a
  gradient from a failed backward is never handed to an optimizer;
* any call of another batch (or one checked per call) first checks calls of an earlier batch that
  nothing checked (a forward with autograd on whose output never reached seqpar's loss nor a
  backward).

So a failure stops every rank, with the original message, before anything uses the batch's result;
it stops them at the end of the forward or backward rather than in the failing layer. Limits: an
exception outside the guarded compute (an MLP running out of memory after attention already did)
still leaves the other ranks waiting, as it does without seqpar; with reentrant activation
checkpointing every checkpointed backward is a pass of its own, so the check runs per layer there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from .. import compat
from .agree import fence

T = TypeVar("T")

DEFERRED_WHAT = "sequence-parallel attention of this batch"
"""What a once-per-batch check names in its message (the same on every rank: only the failing
rank knows which call failed; its message says what failed)."""


class _Pending:
    """This rank's deferred calls since the last check: which groups they used (the check's fence
    stages, in first-use order, the same on every rank), its first failure, and the batch they
    belong to. One per process, because the checks are points the whole program passes through
    (the loss, the end of a backward) rather than points of one call."""

    def __init__(self) -> None:
        self.stages: list[tuple[dist.ProcessGroup, ...]] = []
        self.error: Exception | None = None
        self.batch: object | None = None

    def note(self, groups: tuple[dist.ProcessGroup, ...], batch: object) -> None:
        if groups not in self.stages:
            self.stages.append(groups)
        self.batch = batch

    def clear(self) -> tuple[list[tuple[dist.ProcessGroup, ...]], Exception | None]:
        stages, error = self.stages, self.error
        self.stages, self.error, self.batch = [], None, None
        return stages, error


_PENDING = _Pending()


class Guard:
    """This rank's first failure in the local compute of one collective call, raised on every rank
    by a fence. ``groups``: the fence stages (:func:`seqpar.comm.agree.fence`); ``what`` names the
    call. ``batch``: an object standing for the batch (one per batch, see
    :func:`seqpar.attention.shard.batch_token`) to check the call once per batch instead of per
    call (see the module doc); None checks per call."""

    def __init__(self, groups: Sequence[dist.ProcessGroup], what: str, *, batch: object | None = None) -> None:
        self.groups, self.what, self.batch = tuple(groups), what, batch
        self.error: Exception | None = None
        self._heard: dict[str, bool] = {}  # direction -> did any rank's flag say it failed
        if _PENDING.stages and _PENDING.batch is not batch:  # an earlier batch nothing checked
            check_failures()
        if batch is not None:
            _PENDING.note(self.groups, batch)

    @property
    def deferred(self) -> bool:
        """Checked once per batch (True) or by the call's own fences (False)."""
        return self.batch is not None

    @property
    def failed(self) -> bool:
        return self.error is not None or (self.deferred and _PENDING.error is not None)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)``; None when it raised (the error is kept) or this rank already
        failed (in this call, or in the batch when checked once per batch)."""
        if self.failed:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # kept, and raised on every rank by the fence
            self.error = e
            if self.deferred:
                _PENDING.error = e
            return None

    def flag(self, direction: str) -> _FailureFlag | None:
        """This rank's failure, as a :class:`~seqpar.comm.collectives.Flag` for the last all-to-all of
        ``direction`` (``"forward"`` or ``"backward"``) over this guard's one group; None when
        checked once per batch (nothing to read per call). Nothing guarded may run after that
        exchange in that direction: the fence trusts the flags it heard."""
        if len(self.groups) != 1:
            raise ValueError(f"{self.what}: a failure flag needs a guard of one group, this one has {len(self.groups)}")
        return None if self.deferred else _FailureFlag(self, direction)

    def fence(self, direction: str) -> None:
        """Every rank of the call raises if any rank failed (see :func:`seqpar.comm.agree.fence`).
        Free when a flag of ``direction`` told every rank that none did: they all heard the same.
        Checked once per batch: nothing now; the backward's end is made a check point."""
        if self.deferred:
            _PENDING.note(self.groups, self.batch)
            if direction == "backward":
                # every deferred backward queues one; the first to run checks, the rest find nothing
                compat.queue_backward_callback(check_failures)
            return
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


def pending_failure() -> float | None:
    """1.0 if a call checked once per batch failed on this rank since the last check, 0.0 if not,
    None when no such call ran (nothing to check: the same answer on every rank). A number to
    all-reduce with other numbers, then :func:`check_failures` with the sum."""
    if not _PENDING.stages:
        return None
    return 1.0 if _PENDING.error is not None else 0.0


def check_failures(group: dist.ProcessGroup | None = None, *, any_failed: bool | None = None) -> None:
    """Raise on every rank if a call checked once per batch failed on any rank since the last check;
    clear the record either way. Collective over ``group`` (default: the calls' own groups), so
    every rank of it calls this at the same point; free when no such call ran. ``any_failed``:
    already agreed over the ranks (a sum of :func:`pending_failure`): no collective when False."""
    if not _PENDING.stages:
        return
    stages, error = _PENDING.clear()
    if any_failed is False:
        return
    own = group is None or dist.get_world_size(group) == 1  # nothing to agree over: the calls' own groups
    fence([g for st in stages for g in st] if own else [group], error, what=DEFERRED_WHAT)


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
