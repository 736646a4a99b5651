"""A deliberate refusal (seqpar.Refused) stays a refusal on every rank when it travels the
cross-rank agreement path -- a problem shared by ``agree.check``, a failure verdict of
``agree.fence``, a kernel refusing on one rank under a Guard -- and only then: a refusal next to a
plain error, or ranks that disagree, raise a plain ValueError everywhere. Default run P = 2 (one
spawn); P = 3 with ``-m heavy``."""

import pytest
import torch
import torch.distributed as dist

from seqpar.comm.agree import check, fence, share
from seqpar.comm.launch import run_distributed
from seqpar.errors import Refused
from seqpar.testing.attention_faults import Crash, run_crash

pytestmark = pytest.mark.distributed


def _raised(fn):
    """``(type name, message, type name of the cause)`` of what ``fn`` raised, or None."""
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), type(e.__cause__).__name__ if e.__cause__ is not None else None
    return None


def _worker(rank, world):
    torch.set_num_threads(1)
    g, last = dist.group.WORLD, world - 1

    def shared(problem, refused, n=0.0):
        return lambda: check(share({"n": n}, g, problem=problem, refused=refused), what="test input", same=["n"])

    out = {
        "check: none": _raised(shared(None, False)),
        "check: a refusal": _raised(shared("cannot shard this" if rank == last else None, True)),
        "check: refusals everywhere": _raised(shared(f"cannot shard this on {rank}", True)),
        "check: a refusal and an error": _raised(shared({0: "bad shape", last: "cannot shard this"}.get(rank),
                                                        rank == last)),
        "check: a refusal, facts differ": _raised(shared("cannot shard this" if rank == last else None, True,
                                                         n=float(rank))),
        "fence: a refusal": _raised(lambda: fence(g, Refused("no backward here") if rank == last else None,
                                                  what="test call")),
        "fence: refusals everywhere": _raised(lambda: fence(g, Refused(f"no backward on {rank}"), what="test call")),
        "fence: a refusal and a crash": _raised(lambda: fence(
            g, {0: Refused("no backward here"), last: RuntimeError("out of memory")}.get(rank), what="test call")),
    }
    # a kernel that refuses on the last rank inside the strategies' guarded compute
    for crash in (Crash("ulysses", "forward", Refused), Crash("ring", "backward", Refused),
                  Crash("hybrid", "forward", Refused, ulysses=world)):
        seen = run_crash(crash, rank, world)
        out[f"guard: {crash.label()}"] = (seen["raised"], seen["message"], seen["cause"])
    return out


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.heavy)], ids=lambda p: f"P={p}")
def runs(request):
    return request.param, run_distributed(_worker, request.param, timeout=300)


def test_a_refusal_is_refused_on_every_rank(runs):
    p, per_rank = runs
    last = p - 1
    for name in per_rank[0]:
        assert len({r[name] and r[name][1] for r in per_rank}) == 1, (name, per_rank)  # one message everywhere
    for rank, seen in enumerate(per_rank):
        assert seen["check: none"] is None
        for case in ("check: a refusal", "check: refusals everywhere"):
            assert seen[case][0] == "Refused" and "cannot shard this" in seen[case][1], (case, seen[case])
        assert seen["fence: a refusal"][::2] == ("Refused", "Refused" if rank == last else None)
        assert f"rank {last}: Refused: no backward here" in seen["fence: a refusal"][1]
        assert seen["fence: refusals everywhere"][::2] == ("Refused", "Refused")
        for case in [c for c in seen if c.startswith("guard: ")]:
            assert seen[case][::2] == ("Refused", "Refused" if rank == last else None), (case, seen[case])
            assert f"rank {last}: Refused: kernel failed" in seen[case][1], (case, seen[case])


def test_a_refusal_next_to_another_failure_is_a_plain_error(runs):
    p, per_rank = runs
    last = p - 1
    for rank, seen in enumerate(per_rank):
        for case in ("check: a refusal and an error", "check: a refusal, facts differ"):
            assert seen[case][0] == "ValueError", (case, seen[case])
        assert "bad shape" in seen["check: a refusal and an error"][1]
        assert "differs across ranks" in seen["check: a refusal, facts differ"][1]
        # the failing ranks keep their own kind: the refusing rank a plain ValueError (as the ranks
        # that did not fail raise it), the crashing one its RuntimeError
        want = {0: ("ValueError", "Refused"), last: ("RuntimeError", "RuntimeError")}.get(rank, ("ValueError", None))
        assert seen["fence: a refusal and a crash"][::2] == want, (rank, seen["fence: a refusal and a crash"])
