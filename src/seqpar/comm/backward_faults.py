"""A backward that fails on one rank, or never starts there, told to every rank (:mod:`.faults`).

An exception raised by a backward node (the model's own op, a gradient hook, a checkpointed layer's
recompute, seqpar's own Function) leaves the autograd engine in the failing rank's ``backward()``
call, where seqpar has no frame, while its peers wait in the backward's collectives. The engine
runs a callback queued during a pass (``queue_callback``) only when the whole pass succeeds; when a
node raises it drops the callback unrun -- at once, while the exception is leaving the engine and
before Python sees it, in the thread that called ``backward()`` (measured, torch 2.13 CPU). So the
first seqpar node of each pass queues an :class:`_EndOfBackward`::

    loss.backward() on rank 1
      seqpar's loss node    queue _EndOfBackward                         (one per pass)
      an MLP hook raises    the engine stops, drops the callback unrun -> its finalizer: failed
                            -> a one-shot trace on the Python frame the engine returns to
      back in Python        the trace's "exception" event: publish (rank 1, "the backward", the
                            exception, its traceback); the exception goes on up, with the note
    rank 0, in an all-to-all backward: reads the channel between wait slices -> RankFailed

The trace exists only from a failure until its exception reaches Python: nothing in the steady
state but one callback per pass. Where the trace cannot fire (another tracer in C, such as
coverage's; the callback dropped on an engine thread, as a CUDA backward may), a timer publishes
the failure without its text after :data:`TEXT_WAIT_S`.

**Before the backward.** A loss that requires grad marks its batch as awaiting its backward
(:func:`loss_awaits_backward`); the first seqpar node of a backward clears the mark. A process that
starts its next batch with the mark set never back-propagated that loss (an exception between the
loss and ``backward()`` that the program caught): :func:`seqpar.comm.faults.before_batch` publishes
"rank r did not start the backward of batch n", which frees the peers waiting in that backward.
When every rank skips the same batch's backward, every rank publishes it and it resolves.
"""

from __future__ import annotations

import sys
import threading
from types import FunctionType, MethodType
from typing import Any

from .. import compat
from . import faults

TEXT_WAIT_S = 1.0
"""How long a failed backward waits for its exception to reach Python (where its text is read)
before it is published without that text."""


def loss_awaits_backward() -> None:
    """Called by seqpar's loss when it makes a loss that requires grad: its batch awaits a backward."""
    st = faults.STATE
    if st.group is not None:
        st.awaiting = st.current


def backward_started() -> None:
    """Called by the first seqpar node of a backward pass (the loss's, an attention call's fence):
    the batch's backward began; queue the end-of-pass check once per pass (see the module doc)."""
    st = faults.STATE
    if st.group is None:
        return
    st.awaiting = None
    if st.backward_open:  # this pass already queued one
        return
    st.backward_open = True
    compat.queue_backward_callback(_EndOfBackward(st.current))


class _EndOfBackward:
    """Queued at the start of a pass: called, the pass succeeded; dropped unrun, it failed."""

    def __init__(self, batch: tuple[tuple[int, ...], int]) -> None:
        self.batch, self.ran = batch, False
        self.thread = threading.get_ident()

    def __call__(self) -> None:
        self.ran = True
        faults.STATE.backward_open = False

    def __del__(self) -> None:
        if self.ran or not faults.STATE.backward_open:
            return
        faults.STATE.backward_open = False
        try:
            _report(self.batch, self.thread)
        except Exception:  # a finalizer must not raise; the next batch still refuses to start
            faults.STATE.backward_open = True


def _report(batch: tuple[tuple[int, ...], int], thread: int) -> None:
    """Publish the failed pass of ``batch``: with its exception, read where it reaches Python."""
    pending = _Pending(batch)
    frame = caller_frame() if threading.get_ident() == thread else None
    if frame is not None and isinstance(sys.gettrace(), (type(None), FunctionType, MethodType)):
        _trace_exception(frame, pending.publish)  # a tracer in C (coverage's) would call no f_trace
    pending.timer.start()


def caller_frame() -> Any:
    """The Python frame that called into the engine: the one running below _report <- __del__."""
    try:
        return sys._getframe(3)
    except ValueError:  # no Python frame below: the engine dropped the callback on a thread of its own
        return None


class _Pending:
    """One failed pass, published once: by the trace with its exception, or by the timer without."""

    def __init__(self, batch: tuple[tuple[int, ...], int]) -> None:
        self.batch, self.lock, self.done = batch, threading.Lock(), False
        self.timer = threading.Timer(TEXT_WAIT_S, self.publish, args=(None,))
        self.timer.daemon = True

    def publish(self, error: BaseException | None) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
        self.timer.cancel()
        if error is None:
            error = RuntimeError(f"the backward of batch {self.batch[1]} raised on this rank (its exception did "
                                 "not reach seqpar: see that rank's output)")
        faults.note(error, "the backward", batch=self.batch)


def _trace_exception(frame: Any, on_exception: Any) -> None:
    """Call ``on_exception(exc)`` when an exception arrives in ``frame`` (the engine's caller), then
    put this thread's tracing back as it was. ``frame`` runs a C call right now (the engine), so the
    next event it sees is that exception."""
    previous_global, previous_local = sys.gettrace(), frame.f_trace

    def local(fr: Any, event: str, arg: Any) -> Any:
        if event == "exception" and fr is frame:
            frame.f_trace = previous_local
            sys.settrace(previous_global)
            on_exception(arg[1].with_traceback(arg[2]))  # Python 3.11 sets __traceback__ only once caught
            return previous_local
        return previous_local(fr, event, arg) if previous_local is not None else local

    frame.f_trace = local
    if previous_global is None:
        sys.settrace(_calls_untraced)  # f_trace is called only while this thread traces


def _calls_untraced(_frame: Any, _event: str, _arg: Any) -> None:
    return None
