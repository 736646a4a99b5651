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

The calls of one batch note into the batch's own :class:`FailureRecord` (its SeqShard keeps it, and
it goes with the batch); the process keeps one pointer, to the record with calls nothing checked
yet, because the check points above are points of the program, not of one batch. Inside
``torch.compile`` the guarded compute runs in opaque ops (:mod:`seqpar.attention.ops`) that note into
the same record, and the check points run eagerly (never traced), so both modes raise alike.

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
from . import backward_faults
from .agree import fence

T = TypeVar("T")

DEFERRED_WHAT = "sequence-parallel attention of this batch"
"""What a once-per-batch check names in its message (the same on every rank: only the failing
rank knows which call failed; its message says what failed)."""


class FailureRecord:
    """One batch's calls checked once per batch: which groups they used (the check's fence stages,
    in first-use order, the same on every rank) and this rank's first failure among them. Owned
    by the batch (:class:`seqpar.attention.shard.SeqShard` keeps one for all its layers and
    derived shards); cleared by each check, filled again by the calls after it (the backward)."""

    def __init__(self) -> None:
        self.stages: list[tuple[dist.ProcessGroup, ...]] = []
        self.error: Exception | None = None

    def note(self, groups: tuple[dist.ProcessGroup, ...]) -> None:
        """A call of this batch used ``groups``; from now on this record is the one to check."""
        global _unchecked
        if groups not in self.stages:
            self.stages.append(groups)
        _unchecked = self

    def clear(self) -> tuple[list[tuple[dist.ProcessGroup, ...]], Exception | None]:
        stages, error = self.stages, self.error
        self.stages, self.error = [], None
        return stages, error


_unchecked: FailureRecord | None = None
"""The one batch record with calls since the last check, if any. The check points are points the
whole program passes through (the loss, the end of a backward, the next batch's first call), not
points of one batch, so the process keeps this one pointer to the record they check; the record
itself lives with its batch."""


class Guard:
    """This rank's first failure in the local compute of one collective call, raised on every rank
    by a fence. ``groups``: the fence stages (:func:`seqpar.comm.agree.fence`); ``what`` names the
    call. ``batch``: the batch's :class:`FailureRecord` (see
    :func:`seqpar.attention.shard.deferred_check`) to check the call once per batch instead of per
    call (see the module doc); None checks per call."""

    def __init__(self, groups: Sequence[dist.ProcessGroup], what: str, *, batch: FailureRecord | None = None
                 ) -> None:
        self.groups, self.what, self.batch = tuple(groups), what, batch
        self.error: Exception | None = None
        self._heard: dict[str, bool] = {}  # direction -> did any rank's flag say it failed
        if _unchecked is not None and _unchecked is not batch and _unchecked.stages:  # an earlier batch
            check_failures()  # nothing checked
        if batch is not None:
            batch.note(self.groups)

    @property
    def deferred(self) -> bool:
        """Checked once per batch (True) or by the call's own fences (False)."""
        return self.batch is not None

    @property
    def failed(self) -> bool:
        return self.error is not None or (self.batch is not None and self.batch.error is not None)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)``; None when it raised (the error is kept) or this rank already
        failed (in this call, or in the batch when checked once per batch)."""
        if self.failed:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # kept, and raised on every rank by the fence
            self.error = e
            if self.batch is not None:
                self.batch.error = e
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
        if direction == "backward":  # the batch's backward began here: its failure is told to every rank
            backward_faults.backward_started()
        if self.batch is not None:
            self.batch.note(self.groups)
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


# The check points read and clear the record at run time: under torch.compile they must not be traced
# (a traced read would bake one batch's answer into the graph), so they run eagerly -- a graph break at
# the loss or wherever a check point sits, never inside an attention call.
@torch.compiler.disable
def pending_failure() -> float | None:
    """1.0 if a call checked once per batch failed on this rank since the last check, 0.0 if not,
    None when no such call ran (nothing to check: the same answer on every rank). A number to
    all-reduce with other numbers, then :func:`check_failures` with the sum."""
    if _unchecked is None or not _unchecked.stages:
        return None
    return 1.0 if _unchecked.error is not None else 0.0


@torch.compiler.disable
def check_failures(group: dist.ProcessGroup | None = None, *, any_failed: bool | None = None) -> None:
    """Raise on every rank if a call checked once per batch failed on any rank since the last check;
    clear the record either way. Collective over ``group`` (default: the calls' own groups), so
    every rank of it calls this at the same point; free when no such call ran. ``any_failed``:
    already agreed over the ranks (a sum of :func:`pending_failure`): no collective when False."""
    global _unchecked
    record, _unchecked = _unchecked, None
    if record is None or not record.stages:
        return
    stages, error = record.clear()
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
