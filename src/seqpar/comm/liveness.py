"""Which ranks are still there: a beat per rank in the job's store, read when the transport fails.

A rank that is killed (its host lost, the OOM killer, a SIGKILL) publishes nothing; its peers see only
the transport's error -- gloo: "Connection reset by peer" from whichever collective touched it first --
which names an address, not a rank. So every rank of a torchrun job beats: a thread adds 1 to its
counter in the store every :data:`BEAT_S`. A rank that meets a transport error reads every counter,
waits, and reads again; the ranks whose counters did not move are lost::

    ranks 2, 3 killed at t      -> their counters stop
    rank 1: an all-reduce raises "Connection reset by peer" (t + ms)
            counters {0: 41, 1: 40, 2: 38, 3: 38} ... LOST_WAIT_S later {0: 46, 1: 45, 2: 38, 3: 38}
            -> lost: ranks 2, 3 (torchrun agent 1 on host h2)

Counters, not clocks: hosts' clocks need not agree. The beats go over a store client of their own
with a short timeout (:data:`STORE_TIMEOUT_S`), so a main thread blocked in the store (a barrier)
does not stop them and a store that is gone is noticed in seconds, not at the collective timeout.

The store itself is served by the torchrun agent of rank 0 (its rendezvous store, shared with the
workers). When it is gone nothing can be read: :class:`StoreGone`, and the ranks of that agent --
from the roster every rank gathered at the start (:func:`gather_roster`) -- are the ones lost.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch.distributed as dist

from . import faults
from .channel import LOST, Fault

PREFIX = "seqpar/alive/"
BEAT_S = 1.0
"""Seconds between two beats of a rank (one store add; a job of N ranks adds N / BEAT_S per second)."""
LOST_WAIT_S = 5.0
"""How long a rank that met a transport error watches the counters: a rank alive beats within it
(five beats' time: a thread starved for seconds on a loaded host still beats)."""
STORE_TIMEOUT_S = 15.0
"""Timeout of the beats' store client: how long a read waits for a store host that vanished
without closing its connections (a host that lost power); a killed process's host refuses at once."""


@dataclass(frozen=True)
class Member:
    """One rank of the job: its global ``rank``, the torchrun ``agent`` it runs under (its group
    rank; -1 outside torchrun), its ``local_rank`` there, the ``host`` and the ``pid``."""

    rank: int
    agent: int
    local_rank: int
    host: str
    pid: int


class StoreGone(RuntimeError):
    """The job's store does not answer: the host that serves it (rank 0's torchrun agent) is gone."""


def this_member() -> Member:
    """This process as a :class:`Member`, from the environment torchrun sets."""
    env = os.environ
    return Member(int(env.get("RANK", dist.get_rank() if dist.is_initialized() else 0)),
                  int(env.get("GROUP_RANK", -1)), int(env.get("LOCAL_RANK", 0)), socket.gethostname(), os.getpid())


def gather_roster(group: Any = None) -> list[Member]:
    """Every rank's :class:`Member`, in rank order (one all-gather over ``group``; every rank calls it)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, this_member(), group=group)
    return out


def describe_ranks(ranks: Sequence[int], roster: Sequence[Member]) -> str:
    """``ranks 2, 3 (torchrun agent 1 on host h2)``: the ranks, grouped by where they ran."""
    where: dict[tuple[int, str], list[int]] = {}
    for r in sorted(ranks):
        m = roster[r] if r < len(roster) else Member(r, -1, -1, "?", -1)
        where.setdefault((m.agent, m.host), []).append(r)
    parts = []
    for (agent, host), rs in where.items():
        agent_text = f"torchrun agent {agent} on host {host}" if agent >= 0 else f"host {host}"
        parts.append(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} ({agent_text})")
    return "; ".join(parts)


def agent_ranks(agent: int, roster: Sequence[Member]) -> tuple[int, ...]:
    """The ranks that run under torchrun agent ``agent``."""
    return tuple(m.rank for m in roster if m.agent == agent)


def spanning_groups(roster: Sequence[Member], inner: int) -> list[tuple[int, ...]]:
    """The blocks of ``inner`` consecutive ranks (the mesh's innermost axes: the sp group, tp x sp)
    whose ranks do not all run under one agent on one host -- their collectives would cross hosts.
    Pure: ``roster`` in rank order."""
    out = []
    for first in range(0, len(roster), inner):
        block = roster[first:first + inner]
        if len({(m.agent, m.host) for m in block}) > 1:
            out.append(tuple(m.rank for m in block))
    return out


def unmoved(before: Sequence[int], after: Sequence[int], *, alive: int) -> tuple[int, ...]:
    """The ranks whose beat counters did not move between two reads (``alive``, the reader, excepted). Pure."""
    return tuple(r for r, (a, b) in enumerate(zip(before, after, strict=True)) if a == b and r != alive)


class Liveness:
    """This rank's beats, and the read that finds the lost ranks.

    ``store``: a client of the job's store used by nothing else (its operations must not queue
    behind the main thread's), ideally with a short timeout; ``roster``: :func:`gather_roster`'s
    list (set after the start: see :func:`start`). Beats until :meth:`stop` or until the store
    fails once."""

    def __init__(self, store: Any, rank: int, world: int, *, beat_s: float = BEAT_S,
                 lost_wait_s: float = LOST_WAIT_S, roster: Sequence[Member] = ()) -> None:
        self.store = dist.PrefixStore(PREFIX, store)
        self.rank, self.roster, self.beat_s, self.lost_wait_s = rank, list(roster), beat_s, lost_wait_s
        self.keys = [f"beat/{r}" for r in range(world)]
        self.store.add(self.keys[rank], 1)  # this rank's key exists from now on
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="seqpar-liveness", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self.store.add(self.keys[self.rank], 1)
            except Exception:  # the store is gone: said by whoever reads it next; no warning per second
                return

    def stop(self) -> None:
        self._stop.set()

    def counters(self) -> list[int]:
        """Every rank's beat count (two store round trips; one per rank while some rank has never
        beaten). Raises :class:`StoreGone`."""
        try:
            if self.store.check(self.keys):  # the usual case: one more round trip
                return [int(v) for v in self.store.multi_get(self.keys)]
            return [int(self.store.add(k, 0)) for k in self.keys]  # a get of a missing key would wait
        except Exception as e:
            raise StoreGone(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e

    def lost(self, wait_s: float | None = None, poll_s: float = 0.25) -> tuple[int, ...]:
        """The ranks whose beats stopped: watched for ``wait_s`` (default: the ``lost_wait_s`` it was
        made with; less when every rank beat sooner). Raises :class:`StoreGone`."""
        before = self.counters()
        deadline = time.monotonic() + (self.lost_wait_s if wait_s is None else wait_s)
        while True:
            time.sleep(poll_s)
            now = self.counters()
            still = unmoved(before, now, alive=self.rank)
            if not still or time.monotonic() >= deadline:
                return still

    def answers(self) -> bool:
        """Whether the store answers (one round trip, at most the client's timeout)."""
        try:
            self.counters()
            return True
        except StoreGone:
            return False

    def store_host(self) -> tuple[int, ...]:
        """The ranks that run with the store's host: rank 0's torchrun agent (rank 0 alone outside torchrun)."""
        first = self.roster[0] if self.roster else Member(0, -1, -1, "?", -1)
        return agent_ranks(first.agent, self.roster) if first.agent >= 0 else (first.rank,)

    def lost_fault(self, rank: int, where: str, why: str, batch: tuple[tuple[int, ...], int]) -> Fault | None:
        """The "lost" record rank ``rank`` publishes after a transport error (``why``) in ``where``
        during ``batch``: the ranks whose beats stopped (:meth:`lost`), or None when every rank
        beats. Raises :class:`StoreGone`."""
        lost = self.lost()
        if not lost:
            return None
        one = len(lost) == 1
        message = (f"{describe_ranks(lost, self.roster)} {'is' if one else 'are'} gone: "
                   f"{'its process' if one else 'their processes'} stopped beating in the job's store (killed, "
                   f"crashed, or the host went down); rank {rank} noticed in {where}: {first_line(why)}")
        return Fault(lost[0], where, "", message, "", batch[1], kind=LOST, ranks=batch[0], lost=lost)

    def store_gone_fault(self, rank: int, where: str, why: str, batch: tuple[tuple[int, ...], int],
                         error: BaseException) -> Fault:
        """The fault of a rank that cannot reach the job's store: the torchrun agent that served it
        (rank 0's) is gone, with its ranks. It noticed ``where`` (``why``: the error it met there;
        empty: ``where`` says how). Never published: there is no store to publish to."""
        host = self.store_host()
        how = f"in {where}: {first_line(why)}" if why else where
        message = (f"the job's store does not answer ({first_line(str(error))}), so the torchrun agent that served "
                   f"it is gone, with {describe_ranks(host, self.roster)} (killed, crashed, or the host went down); "
                   f"rank {rank} noticed {how}")
        return Fault(host[0], where, "", message, "", batch[1], kind=LOST, ranks=batch[0], lost=host)


def start(store: Any, *, beat_s: float = BEAT_S) -> Liveness:
    """Start this rank's beats in ``store`` (a client of its own) and gather the roster: a
    collective, every rank of the default group calls it; after it every rank's counter exists."""
    live = Liveness(store, dist.get_rank(), dist.get_world_size(), beat_s=beat_s)
    live.roster = gather_roster()
    return live


def watch(live: Liveness) -> None:
    """From now on, a transport error in the current process group first looks for lost ranks
    (``live``'s beats) and publishes them, or raises RankFailed when the store itself is gone
    (:func:`seqpar.comm.faults.stop` calls :func:`on_transport`)."""
    faults.channel()
    faults.STATE.on_transport = partial(on_transport, live)


def on_transport(live: Liveness, where: str, why: str) -> None:
    """A transport error (``why``) in ``where``: unless the channel already holds another rank's
    fault (the cause), read the beats and publish the ranks that are gone as a "lost" record,
    which every rank then raises. Raises RankFailed when the store itself is gone."""
    st = faults.STATE
    try:
        live.counters()  # the store first, through the client that gives up within STORE_TIMEOUT_S
        if faults.other_cause() is not None:
            return
        fault = live.lost_fault(live.rank, where, why, st.current)
    except StoreGone as e:
        st.stopped = live.store_gone_fault(live.rank, where, why, st.current, e)
        raise faults.rank_failed(st.stopped) from None
    if fault is not None:  # None: every rank beats (a hang or a timeout, not a death)
        faults.publish_record(fault)


def stop_cause(live: Liveness) -> Fault | None:
    """Why this rank is being stopped from outside (torchrun's agent sends SIGTERM when its
    rendezvous store or a local worker went away): the store is gone, or the channel holds
    another rank's unresolved fault; None for an ordinary stop. Reads the beats' store first: it
    answers within its short timeout."""
    try:
        live.counters()
    except StoreGone as e:
        return live.store_gone_fault(live.rank, "when its torchrun agent stopped it (SIGTERM)", "",
                                     faults.STATE.current, e)
    try:
        return faults.other_cause()
    except Exception:
        return None


def first_line(text: str, limit: int = 300) -> str:
    """The first line of ``text``, cut to ``limit`` characters (an error's gist in a message)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."
