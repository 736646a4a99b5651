"""The fault side channel without processes: records through a store, the rule that says which
fault stops the job (resolved when every rank raised in the same batch), the message every rank
raises, and the NCCL watchdog's decision (with a fake abort). The distributed behaviour -- one rank
raising anywhere in a step, every rank stopping -- is tests/train/test_fault_suite.py."""

import threading

import torch.distributed as dist

from seqpar.comm import faults, waits
from seqpar.comm.channel import ABANDONED, RAISED, Channel, Fault, clip, first_unresolved
from seqpar.errors import RankFailed, RankFailedBadInput


def _fault(rank, gen, kind=RAISED, error="RuntimeError", bad_input=False):
    return Fault(rank, "the forward", error, f"boom on {rank}", "Traceback ...", gen, kind=kind, bad_input=bad_input)


def test_records_go_through_the_store_in_order():
    store = dist.HashStore()
    writer, reader = Channel(store, 2), Channel(store, 2)
    assert reader.read() == []
    first = writer.publish(_fault(1, 3))
    second = writer.publish(_fault(0, 3, kind=ABANDONED))
    assert (first.seq, second.seq) == (1, 2)
    got = reader.read()
    assert [(f.rank, f.kind, f.seq) for f in got] == [(1, RAISED, 1), (0, ABANDONED, 2)]
    assert got[0] == first  # every field survives the JSON round trip
    assert reader.read() is got and len(got) == 2  # nothing new: the same list, nothing read twice


def test_a_record_whose_writer_died_is_read_as_unknown():
    store = dist.HashStore()
    ch = Channel(store, 2)
    dist.PrefixStore("seqpar/faults/", store).add("count", 1)  # the number taken, the text never written
    (f,) = ch.read(wait_s=0.1)
    assert f.rank == -1 and "never written" in f.message


def test_which_fault_stops_the_job():
    assert first_unresolved([], 2) is None
    one = _fault(1, 7)
    assert first_unresolved([one], 2) == one  # a peer is (or will be) waiting for rank 1
    every = [_fault(0, 7), _fault(1, 7)]
    assert first_unresolved(every, 2) is None  # a deterministic error on every rank: nothing pending
    assert first_unresolved(every, 3) == every[0]  # rank 2 did not raise: it waits
    mixed = [_fault(0, 7), _fault(1, 8)]
    assert first_unresolved(mixed, 2) == mixed[0]  # different batches: not the same error
    sub = [Fault(r, "the forward", "ValueError", "bad", "", 3, ranks=(0, 1)) for r in (0, 1)]
    assert first_unresolved(sub, 4) is None  # every rank of its mesh (a sub-mesh of the job) raised
    assert first_unresolved(sub[:1], 4) == sub[0]
    gone = _fault(0, 7, kind=ABANDONED)
    assert first_unresolved([*every, gone], 2) == every[0]  # a pending collective: nothing resolves
    assert first_unresolved([gone], 2) == gone


def test_every_rank_raises_the_same_message_naming_the_failing_rank():
    f = _fault(1, 7)
    a, b = faults.rank_failed(f), faults.rank_failed(f)
    assert isinstance(a, RankFailed) and not isinstance(a, ValueError)
    assert str(a) == str(b)
    assert str(a).startswith("seqpar: rank 1 failed in the forward (batch 7): RuntimeError: boom on 1")
    assert "Traceback ..." in str(a) and a.fault is f
    bad = faults.rank_failed(_fault(1, 7, error="ValueError", bad_input=True))
    assert isinstance(bad, RankFailedBadInput) and isinstance(bad, ValueError)  # bad input stays bad input
    assert "stopped waiting in" in _fault(2, 7, kind=ABANDONED).describe()


def test_long_texts_keep_their_end():
    text = "x" * 10 + "y" * 5000
    assert clip("short") == "short"
    assert clip(text).endswith("y" * 100) and len(clip(text)) < 4100


def test_without_a_process_group_nothing_is_published_or_waited():
    assert not dist.is_initialized()
    e = RuntimeError("alone")
    assert faults.publish(e, "the forward") is None and not faults.is_published(e)
    faults.check_peers("an all-gather")  # no channel: returns
    n = faults.before_batch((0, 1))
    assert faults.generation() == n and faults.before_batch((0, 1)) == n + 1  # counted per mesh, nothing raised
    assert faults.before_batch((0, 1, 2)) == 1 and faults.generation() == 1
    with_note = RuntimeError("x")
    with_note.add_note(faults.NOTE + "rank 0 failed")
    assert faults.is_published(with_note)
    assert faults.is_transport(RuntimeError("[pair.cc:553] Connection closed by peer [1.2.3.4]:5"))
    assert not faults.is_transport(RuntimeError("shape mismatch"))


def test_the_watchdog_aborts_once_a_fault_stays_unresolved(monkeypatch):
    cause = _fault(1, 4)
    found = [None]
    monkeypatch.setattr(faults, "channel", lambda: object())
    monkeypatch.setattr(faults, "first_cause", lambda ch: found[0])
    flagged, aborted = [], threading.Event()
    monkeypatch.setattr(faults, "flag", flagged.append)
    dog = waits.Watchdog(watch_s=0.01, grace_s=0.2, abort=aborted.set)
    try:
        assert not dog.fired.wait(0.1)  # nothing in the channel: it only watches
        found[0] = cause
        assert dog.fired.wait(5.0)
        assert aborted.is_set() and flagged == [cause]
    finally:
        dog.stop()
