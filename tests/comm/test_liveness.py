"""Liveness without processes: beats through a real TCPStore from threads, the read that finds the
ranks whose beats stopped, a store that is gone, the "lost" record, and the pure rules (which sp
groups span agents). Two torchrun agents losing one of them for real: tests/train/test_two_agents.py."""

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from seqpar.comm import faults, liveness
from seqpar.comm.channel import LOST, Channel, Fault, first_unresolved
from seqpar.comm.liveness import Liveness, Member, StoreGone
from seqpar.errors import RankFailed

BEAT, WAIT = 0.05, 0.6  # seconds: 12 beats fit in the wait


def roster_of(per_agent=(2, 2), hosts=None):
    out, rank = [], 0
    for agent, n in enumerate(per_agent):
        for local in range(n):
            out.append(Member(rank, agent, local, (hosts or {}).get(agent, f"h{agent}"), 1000 + rank))
            rank += 1
    return out


def _server():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=3))


def test_the_ranks_whose_beats_stopped_are_lost():
    server = _server()
    roster = roster_of()
    ranks = [Liveness(_client(server), r, 4, beat_s=BEAT, lost_wait_s=WAIT, roster=roster) for r in range(4)]
    try:
        assert ranks[0].lost() == ()  # everyone beats: the read ends early
        ranks[2].stop()
        ranks[3].stop()
        ranks[2].thread.join()
        ranks[3].thread.join()
        t0 = time.monotonic()
        assert ranks[1].lost() == (2, 3)
        assert time.monotonic() - t0 >= WAIT  # a rank is called lost only after the whole wait
        fault = ranks[1].lost_fault(1, "an all-reduce", "RuntimeError: Connection reset by peer", ((0, 1, 2, 3), 7))
        assert fault.kind == LOST and fault.lost == (2, 3) and fault.rank == 2 and fault.generation == 7
        assert fault.describe().startswith("ranks 2, 3 (torchrun agent 1 on host h1) are gone")
        assert "rank 1 noticed in an all-reduce: RuntimeError: Connection reset by peer" in fault.describe()
        ranks[2].stop()  # stopping twice is harmless
    finally:
        for r in ranks:
            r.stop()


def test_a_rank_alive_but_not_beating_yet_is_not_lost_while_it_beats_within_the_wait():
    server = _server()
    slow = Liveness(_client(server), 1, 2, beat_s=WAIT / 3)
    fast = Liveness(_client(server), 0, 2, beat_s=BEAT)
    try:
        assert fast.lost(wait_s=WAIT) == ()
    finally:
        slow.stop()
        fast.stop()


def test_a_store_that_is_gone_names_the_agent_that_served_it():
    server = _server()
    roster = roster_of((2, 2))
    live = Liveness(_client(server), 2, 4, beat_s=BEAT, roster=roster)
    try:
        assert live.answers()
        del server  # the store's host (rank 0's agent) is gone
        time.sleep(0.1)
        assert not live.answers()
        with pytest.raises(StoreGone):
            live.lost(wait_s=WAIT)
        fault = live.store_gone_fault(2, "an all-reduce", "RuntimeError: Connection reset by peer", ((), 3),
                                      StoreGone("DistNetworkError: Broken pipe"))
        assert fault.lost == (0, 1) and fault.kind == LOST
        text = str(faults.rank_failed(fault))
        assert "the job's store does not answer" in text and "ranks 0, 1 (torchrun agent 0 on host h0)" in text
        # what a SIGTERM from torchrun's agent finds (no process group here: no channel to read)
        cause = liveness.stop_cause(live)
        assert cause is not None and cause.lost == (0, 1)
        assert cause.describe().endswith("rank 2 noticed when its torchrun agent stopped it (SIGTERM)")
        # what a transport error then raises (faults.stop calls this hook first): RankFailed, and the
        # process is marked as stopped (its collectives are left pending)
        saved = faults.STATE.stopped
        try:
            with pytest.raises(RankFailed, match=r"ranks 0, 1 \(torchrun agent 0 on host h0\).*rank 2 noticed in "
                                                 r"an all-reduce: RuntimeError: Connection reset by peer"):
                liveness.on_transport(live, "an all-reduce", "RuntimeError: Connection reset by peer")
            assert faults.STATE.stopped is not None and faults.STATE.stopped.lost == (0, 1)
        finally:
            faults.STATE.stopped = saved
    finally:
        live.stop()


def test_a_lost_record_stops_every_rank_and_survives_the_store():
    store = dist.HashStore()
    lost = Fault(2, "an all-reduce", "", "ranks 2, 3 (...) are gone", "", 5, kind=LOST, lost=(2, 3))
    raised = Fault(1, "the forward", "RuntimeError", "boom", "", 5)
    writer, reader = Channel(store, 4), Channel(store, 4)
    writer.publish(lost)
    (got,) = reader.read()
    assert got.lost == (2, 3) and got.kind == LOST  # the tuple survives JSON
    assert first_unresolved([got], 4) == got
    assert first_unresolved([raised, got], 4) == raised  # a real error published before the deaths is the cause
    assert first_unresolved([got, raised], 4) == got
    err = faults.rank_failed(got)
    assert isinstance(err, RankFailed) and not isinstance(err, ValueError) and err.fault.lost == (2, 3)
    assert str(err) == "seqpar: ranks 2, 3 (...) are gone"


def test_describing_ranks_groups_them_by_agent_and_host():
    roster = roster_of((2, 2), hosts={0: "a", 1: "b"})
    assert liveness.describe_ranks([3, 2], roster) == "ranks 2, 3 (torchrun agent 1 on host b)"
    assert liveness.describe_ranks([1, 2], roster) == ("rank 1 (torchrun agent 0 on host a); "
                                                       "rank 2 (torchrun agent 1 on host b)")
    outside = [Member(0, -1, 0, "x", 1)]
    assert liveness.describe_ranks([0], outside) == "rank 0 (host x)"
    assert liveness.agent_ranks(1, roster) == (2, 3)


def test_sp_groups_that_cross_agents_are_named():
    assert liveness.spanning_groups(roster_of((2, 2)), 2) == []  # torchrun's numbering: sp pairs stay home
    assert liveness.spanning_groups(roster_of((2, 2)), 4) == [(0, 1, 2, 3)]
    assert liveness.spanning_groups(roster_of((3, 3)), 2) == [(2, 3)]
    assert liveness.spanning_groups(roster_of((4,)), 4) == []
    same_agent_two_hosts = [Member(0, -1, 0, "a", 1), Member(1, -1, 0, "b", 2)]
    assert liveness.spanning_groups(same_agent_two_hosts, 2) == [(0, 1)]


def test_unmoved_counters():
    assert liveness.unmoved([5, 5, 3, 3], [9, 8, 3, 3], alive=0) == (2, 3)
    assert liveness.unmoved([5, 5], [5, 6], alive=0) == ()  # the reader itself is never lost
