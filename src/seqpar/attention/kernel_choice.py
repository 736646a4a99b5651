"""Which CUDA lse kernel ``auto`` runs: the fastest of those verified on this GPU, measured once per
shape class (issue 27).

``cuda_flash``, ``cuda_cudnn`` and ``flex`` compute the same exact attention, each with a backward
that takes the whole row's ``out`` and ``lse``; which is fastest depends on the GPU, the dtype, the
options, the head dim, the GQA ratio, the block's size and whether it needs a mask. Where more
than one is *eligible* (verified on this GPU -- :func:`eligible` -- and honouring the block's
options), ``auto`` runs :class:`FastestKernel`: on the first call of each :class:`ShapeClass`
(device, dtype, options, head dims, GQA ratio, power-of-two buckets of Sq and Sk, a fused or a
masked block, forward or backward) it times every candidate on that call's own inputs (CUDA
events, one warm-up then :data:`REPEATS` runs, no autograd recording), keeps the fastest in the
instance's cache, and then runs it -- the measured results are dropped, the call's result is the
chosen kernel's own. Forward and backward are separate classes: a backward given any kernel's
``out`` and ``lse`` is exact, so each direction takes its own fastest kernel.

Exactness does not depend on the choice: every candidate is checked against the float64 oracle by
its gpu-marked tests, so the choice moves results by rounding only. The choice is per process and
per rank (no collective: timings differ a little between ranks and runs), so two runs, or two ranks,
may round differently. For bitwise-reproducible runs turn measurement off: ``SEQPAR_MEASURE_KERNELS=0``
in the environment gives the fixed order (``cuda_flash``, ``flex``, ``cuda_cudnn``: the first
eligible), or pass ``kernel=`` a name. An environment variable rather than an option (STYLE asks
for none): the choice is a process-wide default under every entry point (``parallelize``,
``sp_attention``, ``seqpar train``) and the torch.compile op, none of which should grow an option
for it. It is read when ``auto`` resolves a kernel, so setting it later takes effect at once.

*Verified on this GPU* is :data:`seqpar.attention.kernels.GPU_VERIFIED` (what passed on the
project's GPU runs, committed) plus this machine's record: ``make gpu-check`` writes the kernels
whose gpu-marked tests passed there to ``$SEQPAR_GPU_RECORD`` (default
``~/.cache/seqpar/gpu_verified.json``), keyed by device name and torch version, and a process on the
same GPU model with the same torch reads it (:func:`recorded_kernels`).

What was chosen, and the times it was chosen on: :func:`seqpar.attention.kernels.describe_kernels`.
"""

from __future__ import annotations

import functools
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import Refused
from .spec import AttnSpec, Kernel, LseKernel, MaskInfo

MEASURE_ENV = "SEQPAR_MEASURE_KERNELS"
RECORD_ENV = "SEQPAR_GPU_RECORD"
REPEATS = 2
"""Timed runs per candidate after one warm-up (flex compiles, cuDNN builds its plan there); the faster counts."""

Timer = Callable[[Callable[[], object], torch.device], float]
"""``timer(fn, device) -> seconds`` of one call of ``fn`` on ``device``."""


def measuring() -> bool:
    """Whether ``auto`` measures its CUDA kernels (``SEQPAR_MEASURE_KERNELS`` is not ``0``)."""
    return os.environ.get(MEASURE_ENV, "1").strip() != "0"


def eligible(order: Iterable[str], verified: Iterable[str], kernels: Mapping[str, Kernel], spec: AttnSpec
             ) -> list[str]:
    """The kernels of ``order`` (in that order) that are ``verified`` and honour ``spec``'s options
    (sinks are folded around any lse kernel)."""
    options, ok = spec.options() - {"sinks"}, set(verified)
    return [name for name in order if name in ok and options <= set(kernels[name].supports or options)]


# ------------------------------------------------------------------------------------------------
# this machine's record of kernels verified on its GPU
# ------------------------------------------------------------------------------------------------

def record_path() -> Path:
    """Where ``make gpu-check`` records the kernels that passed on this machine's GPU."""
    return Path(os.environ.get(RECORD_ENV) or Path.home() / ".cache" / "seqpar" / "gpu_verified.json")


def _machine(device: torch.device) -> str:
    return f"{torch.cuda.get_device_name(device)} | torch {torch.__version__}"


@functools.lru_cache(maxsize=16)
def _read_record(path: str, machine: str) -> frozenset[str]:
    try:
        record = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return frozenset()
    except (OSError, ValueError) as e:
        # warned, not raised: a rank's own file must not stop it alone (its peers would wait in a collective)
        warnings.warn(f"ignoring the GPU record {path} ({e}): delete it, or rerun `make gpu-check` to write it again",
                      stacklevel=3)
        return frozenset()
    return frozenset(record.get(machine, ()) if isinstance(record, dict) else ())


def recorded_kernels(device: torch.device) -> frozenset[str]:
    """The kernels this machine's record lists for ``device``'s GPU model and this torch (read once
    per process and path); empty off CUDA, without a record, or with one that cannot be read (said once)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return frozenset()
    return _read_record(str(record_path()), _machine(device))


def record_verified(names: Iterable[str], device: torch.device | None = None) -> Path:
    """Add ``names`` to this machine's record for ``device``'s GPU (default: the current one) and
    this torch: what ``make gpu-check`` calls after a kernel's gpu-marked tests pass."""
    device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    path = record_path()
    record = json.loads(path.read_text()) if path.exists() else {}
    machine = _machine(device)
    record[machine] = sorted(set(record.get(machine, ())) | set(names))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    _read_record.cache_clear()
    return path


# ------------------------------------------------------------------------------------------------
# the measured choice
# ------------------------------------------------------------------------------------------------

def bucket(n: int) -> int:
    """``n`` rounded up to a power of two: lengths within a factor of two share a measurement."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class ShapeClass:
    """What a measurement stands for: blocks alike in everything that decides which kernel is fastest."""

    device: str
    dtype: torch.dtype
    options: tuple[str, ...]  # "causal" and spec.options() but sinks, sorted
    head_dim: int
    value_dim: int
    gqa: int  # query heads per KV head
    sq: int  # bucket(Sq)
    sk: int  # bucket(Sk)
    block: str  # "masked" (the kernel's rectangles / mask), "fused full", "fused causal"
    direction: str  # "forward" or "backward"

    def __str__(self) -> str:
        dims = f"D={self.head_dim}" + (f"/{self.value_dim}" if self.value_dim != self.head_dim else "")
        return (f"{self.device} {str(self.dtype).removeprefix('torch.')} {'+'.join(self.options) or 'full'} {dims} "
                f"GQA={self.gqa} Sq<={self.sq} Sk<={self.sk} {self.block} {self.direction}")


def shape_class(q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, block: str, direction: str) -> ShapeClass:
    """The class of a block ``q [B, H, Sq, D]``, ``k [B, H_kv, Sk, D]``, ``v [B, H_kv, Sk, Dv]``."""
    options = sorted((spec.options() - {"sinks"}) | ({"causal"} if spec.causal else set()))
    return ShapeClass(str(q.device), q.dtype, tuple(options), q.shape[-1], v.shape[-1], q.shape[1] // k.shape[1],
                      bucket(q.shape[2]), bucket(k.shape[2]), block, direction)


@dataclass(frozen=True)
class Choice:
    """The kernel a shape class runs, and why: ``seconds`` per candidate measured (None: it raised,
    ``failures`` says what), empty when nothing was measured."""

    kernel: str
    reason: str
    seconds: Mapping[str, float | None]
    failures: Mapping[str, str]

    def __str__(self) -> str:
        times = ", ".join(f"{n} {'failed: ' + self.failures[n] if s is None else f'{s * 1e3:.3g} ms'}"
                          for n, s in self.seconds.items())
        return f"{self.kernel} ({self.reason}{': ' + times if times else ''})"


def cuda_event_timer(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of ``fn`` on ``device``'s current stream: one warm-up, then the fastest of
    :data:`REPEATS` runs between CUDA events (elsewhere: wall clock)."""
    fn()
    best = float("inf")
    for _ in range(REPEATS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class FastestKernel(LseKernel):
    """``fastest``: per block, the fastest of ``candidates(device, dtype, spec)`` (eligible kernel
    names, in the fixed order) for the block's :class:`ShapeClass`, measured on its first call with
    ``timer`` (see the module doc). Without measurement (``SEQPAR_MEASURE_KERNELS=0``, or while a
    CUDA graph is captured: a timing would synchronize) the first candidate. Raises
    :class:`~seqpar.errors.Refused` when there is no candidate."""

    name = "fastest"
    supports = frozenset({"window", "softcap", "chunk"})  # any candidate's; each block gets one that honours its own

    def __init__(self, kernels: Callable[[str], LseKernel],
                 candidates: Callable[[torch.device, torch.dtype, AttnSpec], list[str]],
                 timer: Timer = cuda_event_timer) -> None:
        self.kernels, self.candidates, self.timer = kernels, candidates, timer
        self.chosen: dict[ShapeClass, Choice] = {}

    def pick(self, key: ShapeClass, q: Tensor, spec: AttnSpec, run: Callable[[LseKernel], object]) -> LseKernel:
        """The kernel for ``key`` (``run(kernel)`` computes this call's block with it): the cached
        choice, or measured now and kept. Unmeasured picks (measurement off, a CUDA graph being
        captured) are not kept: the class is measured at its first call where it may be."""
        choice = self.chosen.get(key)
        if choice is not None:
            return self.kernels(choice.kernel)
        names = self.candidates(q.device, q.dtype, spec)
        if not names:
            raise Refused(f"kernel='fastest' has no kernel verified on {q.device} for {key} (make gpu-check "
                          "verifies them): use kernel='auto'")
        if len(names) > 1 and (not measuring() or _capturing(q.device)):
            return self.kernels(names[0])
        choice = (Choice(names[0], "the only candidate", {}, {}) if len(names) == 1
                  else self.measure(names, q.device, run))
        self.chosen[key] = choice
        return self.kernels(choice.kernel)

    def measure(self, names: list[str], device: torch.device, run: Callable[[LseKernel], object]) -> Choice:
        """Time ``run`` with each of ``names``; the fastest (the first on a tie). A candidate that
        raises a RuntimeError (a shape its op rejects, out of memory) is not chosen and the error is
        kept in the Choice; if every one raises, the last error is raised."""
        seconds: dict[str, float | None] = {}
        failures: dict[str, str] = {}
        error: RuntimeError | None = None
        with torch.no_grad():
            for name in names:
                kernel = self.kernels(name)
                try:
                    seconds[name] = self.timer(lambda k=kernel: run(k), device)
                except RuntimeError as e:
                    seconds[name], error = None, e
                    failures[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
        timed = {n: s for n, s in seconds.items() if s is not None}
        if not timed:
            assert error is not None
            raise error
        best = min(timed, key=timed.__getitem__)
        return Choice(best, "the fastest measured", seconds, failures)

    def describe(self) -> list[str]:
        """One line per shape class met so far: the kernel it runs and why."""
        return [f"{key}: {choice}" for key, choice in sorted(self.chosen.items(), key=lambda kv: str(kv[0]))]

    # the four entry points of an lse kernel: each finds its block's class, then runs the pick

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None
                ) -> tuple[Tensor, Tensor]:
        key = shape_class(q, k, v, spec, "masked", "forward")
        det = [x.detach() for x in (q, k, v)]
        return self.pick(key, q, spec, lambda kern: kern.forward(*det, spec, mask)).forward(q, k, v, spec, mask)

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: AttnSpec,
                 mask: MaskInfo | None) -> tuple[Tensor, Tensor, Tensor]:
        key = shape_class(q, k, v, spec, "masked", "backward")
        det = [x.detach() for x in (dout, q, k, v, out, lse)]
        kernel = self.pick(key, q, spec, lambda kern: kern.backward(*det, spec, mask))
        return kernel.backward(dout, q, k, v, out, lse, spec, mask)

    def fused_forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, causal: bool) -> tuple[Tensor, Tensor]:
        key = shape_class(q, k, v, spec, f"fused {'causal' if causal else 'full'}", "forward")
        det = [x.detach() for x in (q, k, v)]
        kernel = self.pick(key, q, spec, lambda kern: kern.fused_forward(*det, spec, causal))
        return kernel.fused_forward(q, k, v, spec, causal)

    def fused_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       spec: AttnSpec, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        key = shape_class(q, k, v, spec, f"fused {'causal' if causal else 'full'}", "backward")
        det = [x.detach() for x in (dout, q, k, v, out, lse)]
        kernel = self.pick(key, q, spec, lambda kern: kern.fused_backward(*det, spec, causal))
        return kernel.fused_backward(dout, q, k, v, out, lse, spec, causal)
