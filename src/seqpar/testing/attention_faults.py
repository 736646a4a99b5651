"""A kernel that fails on one rank: every rank must raise, none may hang (the crash contract).

Each scenario runs one strategy with a kernel that raises on the last rank, in the forward or the
backward, and records what every rank raised; then a good call on the same groups shows they
still work. Shared by the attention test suites (which assert it on gloo with a short process-group
timeout, so a hang fails fast instead of waiting).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention.hybrid import hybrid_attention
from ..attention.kernels import DenseSdpaKernel
from ..attention.reference import ReferenceKernel
from ..attention.ring import ring_attention
from ..attention.spec import AttnSpec, LocalKernel, LseKernel, MaskInfo
from ..attention.ulysses import ulysses_attention
from .attention_parity import hybrid_case_groups


class KernelFailure(RuntimeError):
    """The error a failing kernel raises (neither seqpar's nor torch's own type)."""


def _fail(error: type[Exception], rank: int, when: str) -> None:
    if dist.get_rank() == rank:
        raise error(f"kernel failed in the {when} on rank {rank}")


class FailingLseKernel(LseKernel):
    """The reference kernel, raising ``error`` on global rank ``rank`` in the ``when`` pass."""

    name = "failing-lse"
    supports = None

    def __init__(self, rank: int, when: str, error: type[Exception] = KernelFailure) -> None:
        self.rank, self.when, self.error, self.inner = rank, when, error, ReferenceKernel()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None
                ) -> tuple[Tensor, Tensor]:
        if self.when == "forward":
            _fail(self.error, self.rank, "forward")
        return self.inner.forward(q, k, v, spec, mask)

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: AttnSpec,
                 mask: MaskInfo | None) -> tuple[Tensor, Tensor, Tensor]:
        if self.when == "backward":
            _fail(self.error, self.rank, "backward")
        return self.inner.backward(dout, q, k, v, out, lse, spec, mask)


class _FailInBackward(torch.autograd.Function):
    """Forward: identity. Backward: raises on the failing rank (inside a local kernel's own graph)."""

    @staticmethod
    def forward(ctx, x: Tensor, kernel: FailingLocalKernel) -> Tensor:
        ctx.kernel = kernel
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        _fail(ctx.kernel.error, ctx.kernel.rank, "backward")
        return grad, None


class FailingLocalKernel(LocalKernel):
    """torch's SDPA as a plain local kernel (autograd does its backward), failing on ``rank``."""

    name = "failing-local"
    supports = None

    def __init__(self, rank: int, when: str, error: type[Exception] = KernelFailure) -> None:
        self.rank, self.when, self.error, self.inner = rank, when, error, DenseSdpaKernel()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, spec: AttnSpec, mask: MaskInfo | None) -> Tensor:
        if self.when == "forward":
            _fail(self.error, self.rank, "forward")
        return _FailInBackward.apply(self.inner(q, k, v, spec=spec, mask=mask), self)


@dataclass(frozen=True)
class Crash:
    """One scenario: ``strategy`` ("ulysses", "ulysses-local", "ring", "hybrid"), the failing pass,
    the error type, and for hybrid the ulysses degree."""

    strategy: str
    when: str
    error: type[Exception] = KernelFailure
    ulysses: int = 1

    def label(self) -> str:
        extra = f" ulysses={self.ulysses}" if self.strategy == "hybrid" else ""
        return f"{self.strategy} {self.when} {self.error.__name__}{extra}"


def _call(crash: Crash, kernel: object, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    group = dist.group.WORLD
    kw = dict(causal=True, kernel=kernel)
    if crash.strategy.startswith("ulysses"):
        return ulysses_attention(q, k, v, group=group, **kw)
    if crash.strategy == "ring":
        return ring_attention(q, k, v, group=group, **kw)
    ug, rg = hybrid_case_groups(group, crash.ulysses)
    return hybrid_attention(q, k, v, ulysses_group=ug, ring_group=rg, **kw)


def run_crash(crash: Crash, rank: int, world: int) -> dict:
    """What this rank raised (type, message, type of the cause; None if nothing) and whether a good
    call right afterwards still worked."""
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(2, 5, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    cls = FailingLocalKernel if crash.strategy == "ulysses-local" else FailingLseKernel
    seen: dict = {"raised": None, "message": "", "cause": None}
    try:
        _call(crash, cls(world - 1, crash.when, crash.error), q, k, v).sum().backward()
    except Exception as e:
        cause = type(e.__cause__).__name__ if e.__cause__ is not None else None
        seen.update(raised=type(e).__name__, message=str(e), cause=cause)
    out = _call(crash, "reference", q, k, v)  # the groups still work
    out.sum().backward()
    seen["after"] = tuple(out.shape) == tuple(q.shape)
    return seen


def crash_scenarios(world: int) -> list[Crash]:
    """Every strategy (hybrid as ulysses x ring = world x 1 and 1 x world, and 2 x 2 at 4 ranks)
    failing in the forward and the backward; one bad-input failure (ValueError) too."""
    cases = [Crash(s, w) for s in ("ulysses", "ulysses-local", "ring") for w in ("forward", "backward")]
    degrees = sorted({1, world} | ({2} if world == 4 else set()))
    cases += [Crash("hybrid", w, ulysses=u) for u in degrees for w in ("forward", "backward")]
    return [*cases, Crash("ring", "backward", ValueError)]


def run_crashes(rank: int, world: int) -> dict[str, dict]:
    """Worker entry: every scenario of :func:`crash_scenarios` on the default group."""
    return {c.label(): run_crash(c, rank, world) for c in crash_scenarios(world)}


def crash_problems(crash: Crash, per_rank: list[dict]) -> list[str]:
    """What breaks the contract in one scenario's per-rank records (empty: it holds). The last rank
    failed: it raises its own error type chained to the original, the others RuntimeError (ValueError
    for a ValueError), every message the same and naming the rank and its error."""
    world = len(per_rank)
    problems = []
    want_msg = f"rank {world - 1}: {crash.error.__name__}: kernel failed in the {crash.when} on rank {world - 1}"
    other = "ValueError" if issubclass(crash.error, ValueError) else "RuntimeError"
    for rank, seen in enumerate(per_rank):
        want = (crash.error.__name__, crash.error.__name__) if rank == world - 1 else (other, None)
        if (seen["raised"], seen["cause"]) != want:
            problems.append(f"rank {rank} raised {seen['raised']} (cause {seen['cause']}), want {want}")
        if want_msg not in seen["message"] or seen["message"] != per_rank[0]["message"]:
            problems.append(f"rank {rank} message: {seen['message']!r}")
        if not seen["after"]:
            problems.append(f"rank {rank}: the call after the failure did not work")
    return problems
