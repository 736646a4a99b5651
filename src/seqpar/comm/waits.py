"""Waiting for seqpar's collectives so that a fault on another rank ends the wait (:mod:`.faults`).

On the CPU (gloo) a collective blocks the host until every rank took part, so a rank whose peer
failed elsewhere would wait there until the process-group timeout. seqpar's waits go in slices of
:data:`SLICE_S` and read the fault channel between them::

    work = collective(..., async_op=True)
    work.wait(0.5 s) -- done?  return                      (steady state: one wait, no store access)
                     -- not yet: channel has an unresolved fault?  RankFailed (the work stays pending)
                                 else wait the next slice

Collectives (all-gather, all-reduce, all-to-all) wait with a timeout of their own: a gloo collective
that times out stays pending and can be waited again (measured). A point-to-point request cannot: a
timed-out gloo receive closes its connection (measured), so those are waited by one helper thread
while this thread waits, in slices, for it to finish.

On NCCL a wait does not block the host (the stream waits); a rank hangs at its next host read of a
result instead. A watchdog thread (:class:`Watchdog`, started by the first wait on a CUDA tensor)
reads the channel every :data:`WATCH_S` and, when a fault stays unresolved for :data:`GRACE_S`
(every rank raising the same error in one batch resolves within that), flags it and aborts every
process group of this process -- which frees NCCL kernels that wait for a peer -- so the read returns
and :func:`seqpar.comm.faults.raise_if_flagged` raises the fault.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from .. import compat
from . import faults

SLICE_S = 0.5
"""Seconds of one wait slice: the longest a rank waits past a peer's fault (plus one store read)."""
WATCH_S, GRACE_S = 1.0, 5.0
"""NCCL watchdog: seconds between channel reads; how long a fault must stay unresolved before it aborts."""

_SLICE = timedelta(seconds=SLICE_S)
_TIMED_OUT = "Operation timed out!"  # what gloo's Work.wait(timeout) raises when the slice ends first


def wait_work(work: Any, device: torch.device, where: str) -> None:
    """Wait for a collective's ``work`` (``async_op=True``) on tensors of ``device``, in slices
    on the CPU (see the module doc). Raises RankFailed when another rank's fault is published."""
    if device.type != "cpu":
        _watch()
        work.wait()
        return
    if faults.channel() is None:
        work.wait()
        return
    while True:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError as e:
            if str(e) != _TIMED_OUT:
                faults.stop(e, where)
                raise
        faults.check_peers(where)


def wait_requests(reqs: Sequence[Any], device: torch.device, where: str) -> None:
    """Wait for point-to-point requests (``batch_isend_irecv``'s) on tensors of ``device``; on the
    CPU through the helper thread, reading the channel every slice (see the module doc)."""
    if not reqs:
        return
    if device.type != "cpu" or faults.channel() is None:
        if device.type != "cpu":
            _watch()
        for req in reqs:
            req.wait()
        return
    if faults.stopped():  # the helper thread may still be blocked in the request left pending
        faults.check_peers(where)
    job = _Job(reqs)
    _helper().submit(job)
    while not job.done.wait(SLICE_S):
        faults.check_peers(where)
    if job.error is not None:
        faults.stop(job.error, where)
        raise job.error


class _Job:
    def __init__(self, reqs: Sequence[Any]) -> None:
        self.reqs, self.done, self.error = reqs, threading.Event(), None


class _Helper:
    """The thread that blocks in point-to-point waits on this thread's behalf (one per process)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="seqpar-p2p-wait", daemon=True)
        self.thread.start()

    def submit(self, job: _Job) -> None:
        self.jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                _wait_all(job.reqs)
            except BaseException as e:  # handed to the waiting thread, which raises it
                job.error = e
            # the requests hold the collective's buffers: no reference to them may outlive the wait
            job.reqs = ()
            job.done.set()
            del job


def _wait_all(reqs: Sequence[Any]) -> None:
    for req in reqs:
        req.wait()


_HELPER: list[_Helper] = []  # at most one, made on first use


def _helper() -> _Helper:
    if not _HELPER:
        _HELPER.append(_Helper())
    return _HELPER[0]


class Watchdog:
    """A thread that reads the fault channel every ``watch_s`` and, once a fault stays unresolved
    for ``grace_s``, flags it (:func:`seqpar.comm.faults.flag`) and calls ``abort`` (by default:
    abort every process group of this process, which frees NCCL waits), then ends."""

    def __init__(self, *, watch_s: float = WATCH_S, grace_s: float = GRACE_S,
                 abort: Callable[[], None] = compat.abort_all_groups) -> None:
        self.watch_s, self.grace_s, self.abort = watch_s, grace_s, abort
        self.fired = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="seqpar-fault-watchdog", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        since = None
        while not self._stop.wait(self.watch_s):
            ch = faults.channel()
            cause = faults.first_cause(ch) if ch is not None else None
            if cause is None:
                since = None
                continue
            since = since if since is not None else time.monotonic()
            if time.monotonic() - since >= self.grace_s:
                faults.flag(cause)
                try:
                    self.abort()
                finally:
                    self.fired.set()
                return


_WATCHDOG: list[Watchdog] = []


def _watch() -> None:
    """Start the watchdog the first time a wait is on a CUDA tensor with a fault channel."""
    if not _WATCHDOG and faults.channel() is not None:
        _WATCHDOG.append(Watchdog())
