"""Faults injected on one rank of a training job, and what every rank must then do (the fault suite).

A :class:`Case` names a place, the rank that fails and the step; an :class:`Injector` makes that
rank raise :class:`InjectedFault` there (or turn its activations into NaN). Places a model offers
are installed here -- ``forward`` (an MLP, the model's own code), ``attention`` (inside seqpar's
attention function), ``loss`` (seqpar's loss), ``backward`` (a gradient hook in the MLP), ``nan`` --
the rest (``sync``, ``optimizer``, ``save``...) by the loop that runs the case. :func:`run_case`
records what each rank raised and when; :func:`outcome_problems` says what breaks the contract::

    failing rank   raises its own InjectedFault
    every other    raises RankFailed, the same message on each, naming the rank and its error
    every rank     within BOUND_S seconds of the fault; no rank hangs (the launcher's deadline)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import faults

BOUND_S = 10.0
"""The most seconds a rank may take to raise after the fault (gloo on a loaded 2-core CPU; measured
well under 1 s when the failing process is free, see benchmarks/bench_faults.py)."""

MODEL_PLACES = ("forward", "attention", "loss", "backward")


class InjectedFault(RuntimeError):
    """The error an injected fault raises (neither seqpar's nor torch's own type)."""


@dataclass(frozen=True)
class Case:
    """Fail on global rank ``rank`` at ``place`` during optimizer step ``step`` (0-based)."""

    place: str
    rank: int
    step: int = 1

    def label(self) -> str:
        return f"{self.place}@rank{self.rank}/step{self.step}"


@dataclass(frozen=True)
class Outcome:
    """What one rank raised (``raised``: type name, None if nothing), its message, when (wall time),
    and on the failing rank when the fault was injected."""

    raised: str | None
    message: str = ""
    t: float = 0.0
    t_fault: float | None = None
    extra: Any = None


class Injector:
    """Fires ``case`` on its rank and step (:attr:`step` is set by the loop before each step)."""

    def __init__(self, case: Case) -> None:
        self.case, self.step, self.t_fault = case, -1, None
        self.installed = False

    def fires(self, place: str) -> bool:
        c = self.case
        return c.place == place and dist.get_rank() == c.rank and self.step == c.step

    def boom(self, place: str) -> None:
        """Raise the fault if it fires here."""
        if self.fires(place):
            self.t_fault = time.time()
            raise InjectedFault(f"injected in the {place} on rank {self.case.rank} at step {self.step}")

    def install(self, model: nn.Module) -> None:
        """The model's places: hooks on the first decoder layer's MLP (forward, backward, nan)."""
        if self.installed:
            return
        self.installed = True
        mlp = _first_mlp(model)

        def hook(_module: nn.Module, _args: Any, out: Any) -> Any:
            self.boom("forward")
            if self.fires("nan"):
                self.t_fault = time.time()
                return out * float("nan")
            if self.fires("backward") and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: self.boom("backward"))
            return None

        mlp.register_forward_hook(hook)

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """seqpar's own places: its attention function, its loss (the objective seam's per-token
        log-probs included) and ``sync_gradients`` (the first all-reduce inside it) raise when the
        case fires there."""
        import seqpar
        import seqpar.batch.loss as loss_module
        import seqpar.comm.collectives as collectives
        import seqpar.integrations.memory.tiled_head as tiled_head
        import seqpar.objectives.seam as seam
        from seqpar.attention.dispatch import STRATEGIES

        strategies = dict(STRATEGIES)  # what parallelize's attention function calls, by strategy
        saved = [(loss_module, "token_losses", loss_module.token_losses),
                 (tiled_head, "tiled_loss_sum", tiled_head.tiled_loss_sum),
                 (seam, "token_logps_entropy", seam.token_logps_entropy),  # an objective's per-token loss
                 (collectives, "all_reduce", collectives.all_reduce), (seqpar, "sync_gradients", seqpar.sync_gradients)]
        in_sync = [False]

        def wrap(place: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def inner(*args: Any, **kwargs: Any) -> Any:
                if place != "sync" or in_sync[0]:
                    self.boom(place)
                return fn(*args, **kwargs)
            return inner

        def sync(*args: Any, **kwargs: Any) -> Any:
            in_sync[0] = True
            try:
                return loss_module.sync_gradients(*args, **kwargs)
            finally:
                in_sync[0] = False

        for name, fn in strategies.items():
            STRATEGIES[name] = wrap("attention", fn)
        loss_module.token_losses = wrap("loss", loss_module.token_losses)
        tiled_head.tiled_loss_sum = wrap("loss", tiled_head.tiled_loss_sum)
        seam.token_logps_entropy = wrap("loss", seam.token_logps_entropy)
        collectives.all_reduce = wrap("sync", collectives.all_reduce)
        seqpar.sync_gradients = sync
        try:
            yield
        finally:
            for module, name, fn in saved:
                setattr(module, name, fn)
            STRATEGIES.update(strategies)


def _first_mlp(model: nn.Module) -> nn.Module:
    for name, module in model.named_modules():
        if name.endswith("layers.0.mlp"):
            return module
    raise ValueError("the model has no layers.0.mlp to inject a fault into")


def run_case(case: Case, body: Callable[[Injector], Any]) -> Outcome:
    """Run ``body(injector)`` on this rank; what it raised, as the program's last resort (the
    ``sys.excepthook`` of :mod:`seqpar.comm.faults`, the launcher's worker) tells every rank."""
    inj = Injector(case)
    try:
        with inj.patched():
            extra = body(inj)
    except Exception as e:
        try:
            faults.stop(e, "the program (an uncaught exception)")
        except Exception as converted:  # another rank's fault, reaching this one as a transport error
            e = converted
        return Outcome(type(e).__name__, str(e), time.time(), inj.t_fault)
    return Outcome(None, "", time.time(), inj.t_fault, extra)


def outcome_problems(case: Case, outcomes: list[Outcome], *, own: str = "InjectedFault",
                     bound_s: float = BOUND_S) -> list[str]:
    """What breaks the contract in one case's per-rank outcomes (empty: it holds)."""
    problems = []
    t_fault = outcomes[case.rank].t_fault
    if t_fault is None:
        return [f"the fault never fired on rank {case.rank}"]
    want = f"rank {case.rank} failed in"
    peers = [o.message for r, o in enumerate(outcomes) if r != case.rank]
    for r, o in enumerate(outcomes):
        kind = own if r == case.rank else "RankFailed"
        if o.raised != kind:
            problems.append(f"rank {r} raised {o.raised} ({o.message[:200]!r}), want {kind}")
        elif r != case.rank and (want not in o.message or f"{own}: " not in o.message or o.message != peers[0]):
            problems.append(f"rank {r}'s message does not name rank {case.rank} and its {own}: {o.message[:300]!r}")
        if o.t - t_fault > bound_s:
            problems.append(f"rank {r} raised {o.t - t_fault:.1f}s after the fault (bound {bound_s}s)")
    return problems
