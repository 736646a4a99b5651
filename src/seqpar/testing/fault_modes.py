"""A user's own ``parallelize`` loop whose failing rank does not end through seqpar's last resort:
it lives on, goes on to its next batch, or exits at once (the cases of issue 38)::

    place        what rank r does at step k
    forward      its MLP's forward raises
    backward     a gradient hook on its MLP raises inside loss.backward()
    after_loss   user code between the loss and backward() raises (a metrics call)
    no_backward  it skips backward() for the batch, no exception

    mode         what the failing rank does next
    lives        catches its exception and waits (a notebook, a logger): until every peer raised,
                 at most LINGER_S -- so a peer that raises was told, not freed by an exit
    goes_on      catches it and starts its next batch (a loop that skips the bad batch)
    exits        catches it and leaves at once (os._exit), without sys.excepthook

Nothing here publishes the fault: only seqpar's own places may. Every rank returns an
:class:`~seqpar.testing.fault_inject.Outcome` (an exiting rank none: its fault time goes through
the store); :func:`mode_problems` says what breaks the contract.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from .. import compat
from ..attention import dispatch
from ..comm import faults
from .fault_inject import BOUND_S, Case, InjectedFault, Injector, Outcome

PLACES = ("forward", "backward", "after_loss", "no_backward")
MODES = ("lives", "goes_on", "exits")
STRATEGIES = tuple(dispatch.STRATEGIES)
LINGER_S = BOUND_S + 5.0
"""The longest a living failing rank waits for its peers to raise (past the bound: a peer that
raised within the bound was told while the failing process lived)."""

_KEY = "seqpar-test/"


def fault_mode_loop(rank: int, world: int, case: Case, mode: str, strategy: str, untraced: bool = False, *,
                    steps: int = 3, seq: int = 37) -> Outcome | None:
    """Job entry (every rank): the loop of the module doc; what this rank raised, and when.
    ``untraced``: a failed backward's exception is not traced back to Python (as when the engine
    drops its end-of-pass callback on a thread of its own): published by the timer, without its text."""
    import seqpar
    from seqpar.comm import backward_faults
    from seqpar.integrations.models import build_model

    if untraced:
        backward_faults.caller_frame = lambda: None

    store = compat.default_store()
    inj = Injector(case)
    torch.manual_seed(0)
    model, _ = build_model("tiny-llama", dtype=torch.float32)
    hybrid = dict(ulysses=2 if world % 2 == 0 else 1) if strategy == "hybrid" else {}
    mesh = seqpar.init_mesh(sp=world, device_type="cpu", **hybrid)
    seqpar.parallelize(model, mesh, strategy=strategy)
    inj.install(model)
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(steps):
            inj.step = step
            ids = torch.randint(0, 128, (1, seq), generator=g)
            try:
                loss = model(**seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss
                inj.boom("after_loss")
                if inj.fires("no_backward"):
                    inj.t_fault = time.time()
                    store.set(_KEY + "t_fault", repr(inj.t_fault))
                    continue
                loss.backward()
            except InjectedFault as e:
                store.set(_KEY + "t_fault", repr(inj.t_fault))
                if mode == "exits":
                    os._exit(3)
                if mode == "lives":
                    _linger(store, world, rank)
                    return Outcome(type(e).__name__, str(e), time.time(), inj.t_fault, faults.is_published(e))
            model.zero_grad()
        return Outcome(None, "", time.time(), inj.t_fault)
    except Exception as e:
        t = time.time()
        store.set(_KEY + f"raised{rank}", "1")
        return Outcome(type(e).__name__, str(e), t, _t_fault(store) if inj.t_fault is None else inj.t_fault,
                       faults.is_published(e))


def _linger(store: Any, world: int, me: int) -> None:
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        if all(store.check([_KEY + f"raised{r}"]) for r in range(world) if r != me):
            return
        time.sleep(0.05)


def _t_fault(store: Any) -> float | None:
    try:
        store.wait([_KEY + "t_fault"], _seconds(2.0))
        return float(store.get(_KEY + "t_fault"))
    except Exception:
        return None


def _seconds(s: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=s)


def mode_problems(case: Case, mode: str, outcomes: list[Any], *, bound_s: float = BOUND_S) -> list[str]:
    """What breaks the contract in one case's per-rank results (empty: it holds): every other rank
    raised RankFailed naming rank ``case.rank`` and what it missed, the same text on each, within
    ``bound_s`` of the fault; the failing rank's own exception carries the note that it was told."""
    problems, peers = [], []
    want = {"forward": "InjectedFault: injected in the forward", "backward": "InjectedFault: injected in the backward",
            "after_loss": "did not start the backward of batch", "no_backward": "did not start the backward of batch"}
    for r, o in enumerate(outcomes):
        if r == case.rank:
            if mode == "exits":
                if not (getattr(o, "kind", None) == "died"):
                    problems.append(f"rank {r} (exits) did not die: {o!r:.300}")
            elif mode == "lives" and (o.raised != "InjectedFault" or not o.extra):
                problems.append(f"rank {r} (lives) raised {o.raised} (told: {o.extra}): {o.message[:300]!r}")
            continue
        if not isinstance(o, Outcome) or o.raised != "RankFailed":
            problems.append(f"rank {r} did not raise RankFailed: {o!r:.400}")
            continue
        peers.append(o.message)
        if f"rank {case.rank} " not in o.message or want[case.place] not in o.message:
            problems.append(f"rank {r}'s message does not name rank {case.rank} and {want[case.place]!r}: "
                            f"{o.message[:400]!r}")
        if o.t_fault is None or o.t - o.t_fault > bound_s:
            problems.append(f"rank {r} raised {None if o.t_fault is None else round(o.t - o.t_fault, 2)}s after "
                            f"the fault (bound {bound_s}s)")
    if len(set(peers)) > 1:
        problems.append(f"the peers' messages differ: {peers}")
    return problems


def latency(case: Case, outcomes: list[Any]) -> float:
    """Seconds from the fault to the last other rank raising."""
    return max(o.t - o.t_fault for r, o in enumerate(outcomes) if r != case.rank)
