"""Any exception on any rank, told to every rank: published where it is raised, met where peers wait.

A rank that raises outside a collective leaves its peers waiting in their next one (gloo: until the
process-group timeout; NCCL: until the watchdog's). seqpar tells them through the side channel of
:mod:`.channel` (the process group's store)::

    rank 1: model(**local) raises  -> publish {rank 1, "the forward", RuntimeError, "...", batch 7}
                                      -> its own exception goes on up, unchanged (a note says it was told)
    rank 0: waits in an all-to-all -> between wait slices (:mod:`.waits`) reads the channel
                                      -> RankFailed "seqpar: rank 1 failed in the forward (batch 7): ..."

**Where it is published.** Wherever seqpar's code sees the exception go by: the forward of a
parallelized model (the loss inside it), its backward (:mod:`.backward_faults`), ``sync_gradients``,
``seqpar train``'s step, evaluation and checkpoint save, the Trainer integration's training step,
the local launcher's worker -- and, as the last resort, ``sys.excepthook`` for an exception that
ends the program elsewhere. The first
place that sees it publishes it (:func:`publishing`); it is never published twice.

**Where peers meet it.** In seqpar's own collectives on the CPU (gloo), which wait in slices and
read the channel between them (zero cost while a collective completes within its first slice); on
NCCL a watchdog thread reads it and aborts the communicators (:mod:`.waits`). A peer blocked in a
collective that is not seqpar's (DDP's, FSDP's, the user's) is freed on gloo only when the failing
process exits (measured: abort and shutdown do not free a pending gloo collective); its error --
"Connection closed by peer" -- is then turned into the same RankFailed at the next place seqpar
sees it go by. So on gloo a failing process must exit: ``seqpar train`` and the local launcher do,
and a user loop should let the exception end the process (and not call ``destroy_process_group``
in a ``finally``: it hangs while a peer waits in a collective).

**Batches never pair across.** Each process counts the batches it shards over each SP group (:func:`before_batch`,
called by ``shard_batch``, whose one all-gather carries the count: ranks at different batches raise
a ValueError instead of pairing). A process that met a fault does not start another batch until
the fault is resolved (every rank raised in that batch: nothing is pending, see :mod:`.channel`);
one that left a collective pending never starts another (its group is unusable). A backward that
fails is published as its exception leaves autograd, and a loss whose backward never started is
published at the next batch (:mod:`.backward_faults`).

One state per process, because what it tracks is process-wide: the default process group's store,
``sys.excepthook``, and the count of batches the program has run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from .. import compat
from ..errors import RankFailed, RankFailedBadInput
from .channel import ABANDONED, Channel, Fault, clip

NOTE = "seqpar: told every rank: "
"""The start of the note (``BaseException.add_note``) a published exception carries."""

RESOLVE_WAIT_S = 60.0
"""How long a process that met a fault waits, at its next batch, for the fault to resolve (every
rank raised: a deterministic error) before it raises instead of starting the batch."""

_TRANSPORT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
              "Socket Timeout")
"""Text of the errors gloo raises when a peer went away or never came: consequences, not causes."""


class _Process:
    """This process's part: the channel of the default group, the batch count, what it met."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # the NCCL watchdog reads the channel from its own thread
        self.group: Any = None  # the default process group the channel belongs to
        self.channel: Channel | None = None
        self.rank = 0
        self.batches: dict[tuple[int, ...], int] = {}  # batches sharded so far over each mesh (its global ranks)
        self.current: tuple[tuple[int, ...], int] = ((), 0)  # the batch running now: its mesh's ranks, its number
        self.backward_open = False  # a seqpar node began a backward pass whose end has not come yet
        self.awaiting: tuple[tuple[int, ...], int] | None = None  # a batch whose loss awaits its backward
        self.stopped: Fault | None = None  # this process left a collective pending: the group is unusable
        self.involved = False  # this process published or met a fault: resolve it before the next batch
        self.flagged: Fault | None = None  # set by the NCCL watchdog: a fault to raise at the next host read
        self.on_transport: Any = None  # (where, why) -> None, before a transport error is handled (.liveness)
        self.previous_hook: Any = None

    def reset(self, group: Any) -> None:
        self.__init__()  # type: ignore[misc]  -- a new process group: a new job as far as faults go
        self.group = group


STATE = _Process()


def channel() -> Channel | None:
    """The fault channel of the default process group (None without one). Installs the
    ``sys.excepthook`` last resort the first time."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    st = STATE
    group = dist.group.WORLD
    with st.lock:
        if st.group is not group or st.channel is None:
            hook = st.previous_hook
            st.reset(group)
            st.previous_hook = hook
            st.rank = dist.get_rank()
            st.channel = Channel(compat.default_store(), dist.get_world_size())
            _install_excepthook()
        return st.channel


def generation() -> int:
    """The number of the batch running now, counted over its mesh (the number a fault is recorded with)."""
    return STATE.current[1]


def met_fault() -> bool:
    """Whether this process published or met a fault in its current process group."""
    return STATE.involved or STATE.stopped is not None


def stopped() -> bool:
    """Whether this process left a collective pending after a fault: its process group is unusable."""
    return STATE.stopped is not None


# --------------------------------------------------------------------------------------------
# publishing
# --------------------------------------------------------------------------------------------

def is_published(error: BaseException) -> bool:
    return any(str(n).startswith(NOTE) for n in getattr(error, "__notes__", ()))


def is_transport(error: BaseException) -> bool:
    """An error of the transport itself (a peer went away, a collective timed out): the consequence
    of another rank's fault, and the end of this process group."""
    return isinstance(error, dist.DistError) or any(t in str(error) for t in _TRANSPORT)


Batch = tuple[tuple[int, ...], int]
"""A batch: the global ranks of the mesh that runs it, and its number over that mesh."""


def publish(error: BaseException, where: str, *, batch: Batch | None = None) -> Fault | None:
    """Publish ``error``, raised on this rank in ``where`` (during ``batch``: default the current
    one), to every rank (once; never a RankFailed, which is another rank's fault). Returns the
    record, or None when nothing was published. Never raises: a channel that cannot be written must
    not hide the real error."""
    if isinstance(error, RankFailed) or is_published(error):
        return None
    try:
        ch = channel()
        if ch is None:
            return None
        ranks, number = STATE.current if batch is None else batch
        fault = Fault(STATE.rank, where, type(error).__name__, clip(str(error)),
                      clip("".join(traceback.format_exception(error))), number,
                      bad_input=isinstance(error, ValueError), ranks=ranks)
        with STATE.lock:
            fault = ch.publish(fault)
            STATE.involved = True
    except Exception:  # the store is gone (its host exited): the launcher still reports this rank
        return None
    error.add_note(NOTE + fault.describe())
    return fault


def stop(error: BaseException, where: str, *, batch: Batch | None = None) -> None:
    """What a place that sees ``error`` go by does: a transport error caused by another rank's
    fault raises that fault's :class:`RankFailed` (from ``error``); anything else is published
    (as raised in ``batch``, default the current one) and returns (the caller re-raises it)."""
    if not isinstance(error, Exception) or isinstance(error, RankFailed):
        return
    if is_transport(error):
        why = f"{type(error).__name__}: {clip(str(error))}"
        if STATE.on_transport is not None:  # publishes the ranks that are gone (raises: the store is)
            STATE.on_transport(where, why)
        cause = _abandon(where, why)
        if cause is not None and cause.rank != STATE.rank:
            raise rank_failed(cause) from error
    publish(error, where, batch=batch)


def note(error: BaseException, where: str, *, batch: Batch | None = None) -> None:
    """:func:`stop` for a place that must not raise (a forward hook on the way out of a failed
    forward, the end of a failed backward): ``error`` is published, or this rank marked as having
    left a collective pending."""
    try:
        stop(error, where, batch=batch)
    except RankFailed:
        pass


@contextlib.contextmanager
def publishing(where: str) -> Iterator[None]:
    """Publish an exception that leaves the block (see :func:`stop`): ``with publishing("the forward"):``."""
    try:
        yield
    except Exception as e:
        stop(e, where)
        raise


def rank_failed(fault: Fault) -> RankFailed:
    """The error every rank but the failing one raises: the same text on each."""
    text = f"seqpar: {fault.describe()}"
    if fault.traceback:
        text += "\n  its traceback:\n    " + fault.traceback.rstrip().replace("\n", "\n    ")
    cls = RankFailedBadInput if fault.bad_input else RankFailed
    return cls(text, fault)


# --------------------------------------------------------------------------------------------
# meeting a fault
# --------------------------------------------------------------------------------------------

def other_cause() -> Fault | None:
    """The channel's first unresolved raised or lost record from another rank, if any."""
    ch = channel()
    cause = first_cause(ch) if ch is not None else None
    return None if cause is None or cause.kind == ABANDONED or cause.rank == STATE.rank else cause


def check_peers(where: str) -> None:
    """Called between the slices of a wait in ``where``: raise RankFailed if the channel holds an
    unresolved fault (this rank then leaves the collective pending: its group is unusable)."""
    ch = channel()
    if ch is None:
        return
    try:
        with STATE.lock:
            ch.read()
            cause = ch.first_unresolved()
    except Exception:  # the store is gone: the transport will say it
        return
    if cause is None:
        return
    _abandon(where, f"after {cause.describe()}")
    raise rank_failed(cause)


def _abandon(where: str, why: str) -> Fault | None:
    """Mark this process as having left a collective pending (published once: nothing resolves
    after it); returns the first unresolved fault, the cause."""
    st = STATE
    try:
        ch = channel()
        if ch is None:
            return None
        with st.lock:
            if st.stopped is None:
                st.stopped = ch.publish(Fault(st.rank, where, "", why, "", st.current[1], kind=ABANDONED,
                                              ranks=st.current[0]))
                st.involved = True
            ch.read()
            return ch.first_unresolved()
    except Exception:
        return None


def flag(fault: Fault) -> None:
    """Called by the NCCL watchdog: ``fault`` is raised at the next :func:`raise_if_flagged`."""
    STATE.flagged = fault


def raise_if_flagged() -> None:
    """After a host read of a collective's result: raise the fault the watchdog saw (it aborted the
    communicators, so that result is garbage). Free: one attribute read."""
    fault = STATE.flagged
    if fault is not None:
        raise rank_failed(fault)


def before_batch(ranks: tuple[int, ...]) -> int:
    """Called by ``shard_batch`` before its all-gather, with the global ranks of its mesh (the ranks
    that run the batch: its SP group and the dp ranks its gradients meet); returns the batch's number
    over that mesh -- which every rank of the mesh counts alike, while a process may also run batches
    over other meshes (a sub-mesh). Raises, without any collective, when this process cannot start
    a batch: it left a collective pending, its previous backward failed, or a fault it met does not
    resolve within :data:`RESOLVE_WAIT_S`."""
    st = STATE
    ch = channel()
    number = st.batches[ranks] = st.batches.get(ranks, 0) + 1
    previous, st.current = st.current, (ranks, number)
    if ch is None:
        return number
    if st.awaiting is not None:  # the previous batch's loss never reached backward(): tell its peers
        _missing_backward(st.awaiting, number)
    if st.backward_open:  # a backward failed, unpublished (see backward_faults), and the caller went on
        st.backward_open = False
        st.current = previous  # recorded in the batch it happened in
        err = RuntimeError(f"seqpar: the backward of batch {previous[1]} failed on this rank and the program went "
                           f"on; its peers may be waiting in that backward's collectives, so batch {number} cannot "
                           "start: let the exception end the process")
        publish(err, "the backward")
        st.current = (ranks, number)
        raise err
    if st.stopped is not None:
        raise rank_failed(first_cause(ch) or st.stopped)
    if st.involved:
        _wait_resolved(ch)
    return number


def first_cause(ch: Channel) -> Fault | None:
    try:
        with STATE.lock:
            ch.read()
            return ch.first_unresolved()
    except Exception:
        return None


def _wait_resolved(ch: Channel) -> None:
    deadline = time.monotonic() + RESOLVE_WAIT_S
    while True:
        cause = first_cause(ch)
        if cause is None:
            STATE.involved = False
            return
        if cause.kind == ABANDONED or any(f.kind == ABANDONED for f in ch.records) or time.monotonic() > deadline:
            raise rank_failed(cause)
        time.sleep(0.05)


def _missing_backward(batch: Batch, number: int) -> None:
    """Publish that this rank never started the backward of ``batch`` (it starts batch ``number``):
    its peers may wait in that backward. Every rank skipping the same backward resolves it."""
    STATE.awaiting = None
    fault = Fault(STATE.rank, "the backward", "", f"did not start the backward of batch {batch[1]} (it started batch "
                  f"{number} instead: an exception between the loss and backward() that the program caught?)",
                  "", batch[1], ranks=batch[0])
    publish_record(fault)


def publish_record(fault: Fault) -> None:
    """Add ``fault`` to the channel as it is (this process then met a fault); never raises."""
    try:
        with STATE.lock:
            ch = channel()
            if ch is not None:
                ch.publish(fault)
                STATE.involved = True
    except Exception:  # the store is gone: the transport (or the next reader) will say it
        pass


# --------------------------------------------------------------------------------------------
# the last resort
# --------------------------------------------------------------------------------------------

def _install_excepthook() -> None:
    if getattr(sys.excepthook, "__name__", "") == _excepthook.__name__:
        return
    STATE.previous_hook = sys.excepthook
    sys.excepthook = _excepthook


def _excepthook(etype: type[BaseException], value: BaseException, tb: Any) -> None:
    """Publish an exception that ends the program (once), print it as before, and leave at once
    if this process left a collective pending (its interpreter teardown would wait for the peer:
    measured on gloo)."""
    converted = None
    try:
        stop(value, "the program (an uncaught exception)")
    except RankFailed as e:
        converted = e
    except Exception:
        pass
    (STATE.previous_hook or sys.__excepthook__)(etype, value, tb)
    if converted is not None:
        print(f"\n{converted}", file=sys.stderr)
    if STATE.stopped is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

