"""One trial of ``seqpar bench --max-seq``: the peak resident memory of one full training step from
fresh processes, counted from the runtime baseline (torch, the process group, the code paths warmed
on a tiny model) -- weights, AdamW states, gradients and activations all count, as on a GPU -- under
a per-rank cap that a watchdog enforces."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from .build import bench_batch, layout_for, mesh_for, prepare, train_step
from .case import BenchCase
from .malloc import exact_malloc
from .probes import peak_rss_mib, reset_peak_rss, rss_mib
from .watchdog import OVER_CAP_EXIT, RssWatchdog

_TINY = '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 128}'


def warm_runtime(case: BenchCase, mesh: Any, device: torch.device) -> None:
    """Load every code path a step runs (transformers' modules, kernels, AdamW) on a tiny model of
    the same family, so the baseline taken after it holds the runtime and not the model."""
    tiny = replace(case, model_config=_TINY, sizing="builtin", seq_len=max(16, 4 * case.nproc))
    model, opt = prepare(tiny, mesh, device)
    del model, opt
    gc.collect()


def measured_step(warm: Callable[[], None], prepare: Callable[[], Any], step: Callable[[Any], None],
                  cap_bytes: int | None = None, live: bool | str = False) -> dict[str, Any]:
    """Peak resident memory of one training step from this fresh process's runtime baseline: ``warm()``
    loads every code path (on a tiny model), the baseline is taken, then ``state = prepare()`` builds
    the model and optimizer (a warm-up step: gradients and AdamW states exist) and ``step(state)``
    runs the measured step. With ``cap_bytes`` a watchdog stops the process past the cap (see
    :class:`RssWatchdog`); with ``live`` the step also runs under :class:`seqpar.testing.memory.LiveMemory`
    (the peak of tensor storage the step itself creates; ``live="census"``: under
    :class:`~seqpar.bench.census.PeakCensus`, whose census at the peak comes back as ``census``).
    Returns MiB: ``peak_mib`` (VmHWM - baseline), ``base_mib``, ``live_mib`` (nan without ``live``);
    seconds: ``step_s`` (wall) and ``cpu_s`` (this process's CPU time) of the measured step."""
    from seqpar.testing.memory import MIB, LiveMemory

    from .census import PeakCensus

    exact_malloc()
    warm()
    gc.collect()
    base = rss_mib()
    reset_ok = reset_peak_rss()
    dog = RssWatchdog(int(base * MIB) + cap_bytes) if cap_bytes is not None else None
    out: dict[str, Any] = {"live_mib": float("nan")}
    try:
        state = prepare()
        gc.collect()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if live:
            with (PeakCensus() if live == "census" else LiveMemory()) as probe:
                step(state)
            out["live_mib"] = probe.peak_bytes / MIB
            if isinstance(probe, PeakCensus):
                out["census"] = probe.census
        else:
            step(state)
        out.update(step_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0)
    finally:
        if dog is not None:
            dog.stop()
    return {**out, "peak_mib": peak_rss_mib(reset_ok) - base, "base_mib": base}


def measured_cuda_step(warm: Callable[[], None], prepare: Callable[[], Any], step: Callable[[Any], None],
                       device: torch.device) -> dict[str, Any]:
    """:func:`measured_step` on a GPU: the caching allocator's peak above the baseline taken after
    ``warm()`` (``torch.cuda.max_memory_allocated``: weights, gradients, AdamW states and the step's
    activations), ``peak_mib`` infinite where the step ran out of memory. No live probe, no watchdog:
    the device's own memory is the cap."""
    from seqpar.testing.memory import MIB

    warm()
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    nan = float("nan")
    try:
        state = prepare()
        dist.barrier()
        torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        step(state)
        torch.cuda.synchronize(device)
        step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    except torch.OutOfMemoryError:
        return {"peak_mib": float("inf"), "base_mib": base / MIB, "live_mib": nan, "step_s": nan, "cpu_s": nan}
    return {"peak_mib": (torch.cuda.max_memory_allocated(device) - base) / MIB, "base_mib": base / MIB,
            "live_mib": nan, "step_s": step_s, "cpu_s": cpu_s}


def step_peak(case: BenchCase, mesh: Any, cap_bytes: int | None = None, live: bool | str = False,
              batch: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Peak resident memory of training, from this fresh process's runtime baseline (torch, the
    process group, the code paths warmed up) to the end of one full step at ``case.seq_len``: the
    model's weights, a warm-up step's AdamW states, then the step's activations and gradients
    (:func:`measured_step`; ``live``: the live-tensor peak of the step too). ``batch``: the full
    row to train on (default :func:`~seqpar.bench.build.bench_batch` of the case)."""
    device = torch.device("cpu")
    batch = batch if batch is not None else bench_batch(case.seq_len, case.doc_len, case.seed)
    layout = layout_for(case.strategy)
    return measured_step(lambda: warm_runtime(case, mesh, device), lambda: prepare(case, mesh, device),
                         lambda built: train_step(*built, mesh, batch, layout), cap_bytes, live)


def peak_worker(rank: int, world: int, case: BenchCase, cap_bytes: int | None, live: bool | str = False
                ) -> dict[str, Any]:
    """:func:`step_peak` on one of ``world`` fresh local processes."""
    return step_peak(case, mesh_for(case, "cpu"), cap_bytes, live)


@dataclass(frozen=True)
class Trial:
    """One run of :func:`try_step`: ``fits`` when every rank's peak stayed within the cap."""

    seq_len: int
    fits: bool
    peak_mib: float  # max over the ranks (nan where the watchdog stopped a rank)
    step_s: float
    stopped: bool  # a watchdog (or the kernel's OOM killer) ended a rank
    live_mib: float = float("nan")  # max over the ranks of the step's live-tensor peak (measured with live=True)
    cpu_s: float = float("nan")  # max over the ranks of the step's process CPU time
    census: dict[Any, int] | None = None  # live="census": the census at the peak of the rank with the highest one


def try_step(case: BenchCase, cap_bytes: int | None, timeout: float = 900.0, *, live: bool | str = False,
             worker: Callable[..., dict[str, Any]] = peak_worker) -> Trial:
    """One full training step of ``case`` on fresh processes under ``cap_bytes`` per rank:
    ``worker(rank, world, case, cap_bytes, live)`` on each (default :func:`peak_worker`, seqpar's
    step; a peer's harness passes its own, returning :func:`measured_step`'s figures)."""
    from seqpar.comm.launch import WorkerError, run_distributed

    try:
        per_rank = run_distributed(worker, case.nproc, case, cap_bytes, live, timeout=timeout, pg_timeout=timeout,
                                   env={"OMP_NUM_THREADS": "1"})
    except WorkerError as e:
        killed = [f for f in e.errors.values() if f.kind == "died" and f.exit_code in (OVER_CAP_EXIT, -9)]
        if cap_bytes is None or not killed:
            raise
        return Trial(case.seq_len, False, float("nan"), float("nan"), True)
    peak = max(r["peak_mib"] for r in per_rank)
    fits = cap_bytes is None or peak * 2**20 <= cap_bytes
    lives = [r.get("live_mib", float("nan")) for r in per_rank]
    live = float("nan") if any(v != v for v in lives) else max(lives)  # nan unless every rank measured it
    top = max(range(len(per_rank)), key=lambda i: lives[i] if lives[i] == lives[i] else 0.0)
    return Trial(case.seq_len, fits, peak, max(r["step_s"] for r in per_rank), False, live,
                 max(r.get("cpu_s", float("nan")) for r in per_rank), per_rank[top].get("census"))
