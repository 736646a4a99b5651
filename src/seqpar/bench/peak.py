"""One trial of ``seqpar bench --max-seq``: the peak resident memory of one full training step from
fresh processes, counted from the runtime baseline (torch, the process group, the code paths warmed
on a tiny model) -- weights, AdamW states, gradients and activations all count, as on a GPU -- under
a per-rank cap that a watchdog enforces."""

from __future__ import annotations

import gc
import time
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


def step_peak(case: BenchCase, mesh: Any, cap_bytes: int | None = None) -> dict[str, float]:
    """Peak resident memory of training, from this fresh process's runtime baseline (torch, the
    process group, the code paths warmed up) to the end of one full step at ``case.seq_len``: the
    model's weights, a warm-up step's AdamW states, then the step's activations and gradients.
    With ``cap_bytes`` a watchdog stops the process past the cap (see :class:`RssWatchdog`).
    Returns MiB: ``peak_mib`` (VmHWM - baseline), ``base_mib``, and ``step_s`` of the measured step."""
    from seqpar.testing.memory import MIB

    device = torch.device("cpu")
    exact_malloc()
    warm_runtime(case, mesh, device)
    base = rss_mib()
    reset_ok = reset_peak_rss()
    dog = RssWatchdog(int(base * MIB) + cap_bytes) if cap_bytes is not None else None
    try:
        model, opt = prepare(case, mesh, device)
        batch = bench_batch(case.seq_len, case.doc_len, case.seed)
        dist.barrier()
        t0 = time.perf_counter()
        train_step(model, opt, mesh, batch, layout_for(case.strategy))
        step_s = time.perf_counter() - t0
    finally:
        if dog is not None:
            dog.stop()
    return {"peak_mib": peak_rss_mib(reset_ok) - base, "base_mib": base, "step_s": step_s}


def peak_worker(rank: int, world: int, case: BenchCase, cap_bytes: int | None) -> dict[str, float]:
    """:func:`step_peak` on one of ``world`` fresh local processes."""
    return step_peak(case, mesh_for(case, "cpu"), cap_bytes)


@dataclass(frozen=True)
class Trial:
    """One run of :func:`try_step`: ``fits`` when every rank's peak stayed within the cap."""

    seq_len: int
    fits: bool
    peak_mib: float  # max over the ranks (nan where the watchdog stopped a rank)
    step_s: float
    stopped: bool  # a watchdog (or the kernel's OOM killer) ended a rank


def try_step(case: BenchCase, cap_bytes: int | None, timeout: float = 900.0) -> Trial:
    """One full training step of ``case`` on fresh processes under ``cap_bytes`` per rank."""
    from seqpar.comm.launch import WorkerError, run_distributed

    try:
        per_rank = run_distributed(peak_worker, case.nproc, case, cap_bytes, timeout=timeout, pg_timeout=timeout,
                                   env={"OMP_NUM_THREADS": "1"})
    except WorkerError as e:
        killed = [f for f in e.errors.values() if f.kind == "died" and f.exit_code in (OVER_CAP_EXIT, -9)]
        if cap_bytes is None or not killed:
            raise
        return Trial(case.seq_len, False, float("nan"), float("nan"), True)
    peak = max(r["peak_mib"] for r in per_rank)
    fits = cap_bytes is None or peak * 2**20 <= cap_bytes
    return Trial(case.seq_len, fits, peak, max(r["step_s"] for r in per_rank), False)
