"""``seqpar bench``'s numbers for one case: the step's memory per rank above a warm baseline (live
tensors counted on the CPU with peak RSS beside them, the allocator's peak on CUDA) and the median
step time; locally in fresh worker processes per case, under torchrun every case in one job."""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from .build import bench_batch, layout_for, mesh_for, prepare, train_step
from .case import BenchCase
from .probes import peak_rss_mib, reset_peak_rss, rss_mib


def probe_step(model: Any, opt: Any, mesh: Any, batch: dict[str, torch.Tensor], layout: str) -> int:
    """Bytes of live tensor storage at the peak of one training step, above what existed before it."""
    from seqpar.testing.memory import LiveMemory

    gc.collect()
    with LiveMemory() as probe:
        train_step(model, opt, mesh, batch, layout)
    return probe.peak_bytes


def measure(case: BenchCase, mesh: Any, device: torch.device) -> dict[str, float]:
    """Peak memory above the baseline (MiB), on CPU also peak RSS, and median step time (s) on this rank."""
    from seqpar.testing.memory import MIB

    layout = layout_for(case.strategy)
    model, opt = prepare(case, mesh, device)
    batch = {k: v.to(device) for k, v in bench_batch(case.seq_len, case.doc_len, case.seed).items()}
    gc.collect()
    untimed = 1  # the first full step is not timed (allocator and caches warm up)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device) / MIB
        torch.cuda.reset_peak_memory_stats(device)
    else:  # on CPU that first step carries the probe (it slows the step down)
        live = probe_step(model, opt, mesh, batch, layout) / MIB
        untimed = 0
        base = rss_mib()
        reset_ok = reset_peak_rss()
    times = []
    for _ in range(case.steps + untimed):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(model, opt, mesh, batch, layout)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    del model, opt
    step_s = statistics.median(times[untimed:])
    if device.type == "cuda":
        return {"mem_mib": max(0.0, torch.cuda.max_memory_allocated(device) / MIB - base), "step_s": step_s}
    return {"mem_mib": live, "rss_mib": max(0.0, peak_rss_mib(reset_ok) - base), "step_s": step_s}


def bench_worker(rank: int, world: int, case: BenchCase) -> dict[str, float]:
    """One configuration on ``world`` fresh local processes (:func:`seqpar.comm.launch.run_distributed`)."""
    return measure(case, mesh_for(case, "cpu"), torch.device("cpu"))


def run_case(case: BenchCase, timeout: float = 900.0) -> dict[str, Any]:
    """Measure one case in fresh processes; returns the row (max memory over the ranks)."""
    from seqpar.comm.launch import run_distributed

    per_rank = run_distributed(bench_worker, case.nproc, case, timeout=timeout, pg_timeout=timeout,
                               env={"OMP_NUM_THREADS": "1"})
    return {**asdict(case), "switches": case.switches.label, "mem_mib": max(r["mem_mib"] for r in per_rank),
            "mem_mib_per_rank": [round(r["mem_mib"], 1) for r in per_rank],
            "rss_mib": max(r["rss_mib"] for r in per_rank),
            "step_s": max(r["step_s"] for r in per_rank), "measure": "live tensors"}


def torchrun_rows(all_cases: list[BenchCase]) -> list[dict[str, Any]] | None:
    """Under torchrun, on GPUs: every case in this one job (the world size is P, whatever --nproc
    says; the 1-rank cases run on each rank alone, dp = world), the allocator's peak reset between
    cases. Rows on rank 0, None elsewhere."""
    from datetime import timedelta

    # on CPU, memory freed by one case stays resident for the next, so RSS cannot be measured this way
    assert torch.cuda.is_available(), "checked by the caller"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl"
    torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=900))
    world = dist.get_world_size()
    rows = []
    try:
        for case in all_cases:
            if case.nproc not in (1, world):
                continue  # other P need another torchrun
            r = measure(case, mesh_for(case, device.type), device)
            table = torch.tensor([r["mem_mib"], r["step_s"]], dtype=torch.float64, device=device)
            out = [torch.zeros_like(table) for _ in range(world)]
            dist.all_gather(out, table)
            mems = [float(t[0]) for t in out]
            rows.append({**asdict(case), "switches": case.switches.label, "mem_mib": max(mems),
                         "mem_mib_per_rank": [round(m, 1) for m in mems],
                         "step_s": max(float(t[1]) for t in out), "measure": "CUDA allocator peak"})
    finally:
        dist.destroy_process_group()
    return rows if int(os.environ.get("RANK", 0)) == 0 else None
