"""``seqpar bench``: per-rank peak memory and step time of a training step, P ranks vs 1.

One training step (forward, backward, gradient sync, AdamW) of a model on one row of N tokens,
sequence-parallel over P ranks, compared with the same step on one rank. Memory is what the step
adds on top of an idle baseline measured in the same process after a warm-up step (weights,
gradients and optimizer states exist by then), so the ratio shows how the sequence-length
dependent part -- activations -- divides over the ranks:

* CPU: peak resident set size. Each configuration runs in fresh worker processes, and the peak
  is reset after the baseline (``/proc/self/clear_refs``; else the process's peak since start,
  which is why processes are fresh).
* CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``) after a reset.

Step time is the median over the timed steps; with more workers than cores (CPU) it measures the
machine's contention, not seqpar.
"""

from __future__ import annotations

import gc
import os
import re
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class BenchCase:
    model: str
    model_config: str
    nproc: int
    strategy: str  # "ulysses", "ring", "hybrid" ("ulysses" at nproc 1: no communication)
    seq_len: int
    steps: int = 3
    dtype: str = "float32"
    seed: int = 0


# --------------------------------------------------------------------------------------------
# memory probes
# --------------------------------------------------------------------------------------------

def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), flags=re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_mib() -> float:
    kib = _status_kib("VmRSS")
    if kib is None:  # no /proc: the peak so far is the best available
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (1024 if sys.platform == "darwin" else 1)
    return kib / 1024


def _peak_rss_mib(reset_ok: bool) -> float:
    kib = _status_kib("VmHWM") if reset_ok else None
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (1024 if sys.platform == "darwin" else 1)
    return kib / 1024


# --------------------------------------------------------------------------------------------
# one measurement
# --------------------------------------------------------------------------------------------

def _build(case: BenchCase, mesh: Any, device: torch.device) -> tuple[Any, Any]:
    import seqpar
    from seqpar.integrations.models import build_model
    from seqpar.train.config import DTYPES, TrainConfig, model_overrides
    from seqpar.train.tasks import CopyTask

    dtype = DTYPES[case.dtype]
    torch.manual_seed(case.seed)
    overrides = model_overrides(TrainConfig(model=case.model, model_config=case.model_config))
    model, _ = build_model(case.model, dtype=dtype, vocab_size=CopyTask(case.seq_len).vocab_size,
                           max_position_embeddings=case.seq_len, **overrides)
    model.to(device)
    seqpar.parallelize(model, mesh, strategy=case.strategy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model: Any, opt: Any, mesh: Any, batch: dict[str, torch.Tensor], layout: str) -> None:
    import seqpar

    local = seqpar.shard_batch(batch, mesh, layout=layout)
    model(**local).loss.backward()
    seqpar.sync_gradients(model, mesh)
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(case: BenchCase, mesh: Any, device: torch.device) -> dict[str, float]:
    """Peak memory above the idle baseline (MiB) and median step time (s) on this rank."""
    from seqpar.train.tasks import CopyTask

    layout = "contiguous" if case.strategy == "ulysses" else "zigzag"
    model, opt = _build(case, mesh, device)
    sp = case.nproc
    warm = CopyTask(max(CopyTask.min_seq_len, 4 * sp)).row(0)  # small: allocates grads and AdamW states
    _step(model, opt, mesh, {k: v[None].to(device) for k, v in warm.items()}, layout)
    batch = {k: v[None].to(device) for k, v in CopyTask(case.seq_len, case.seed).row(0).items()}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        reset_ok = True
    else:
        base = _rss_mib()
        reset_ok = _reset_peak_rss()
    times = []
    for _ in range(case.steps + 1):  # the first one is not timed (allocator and caches warm up)
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, opt, mesh, batch, layout)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = _peak_rss_mib(reset_ok)
    del model, opt
    return {"mem_mib": max(0.0, peak - base), "base_mib": base, "step_s": statistics.median(times[1:])}


def _mesh_for(case: BenchCase, device_type: str) -> Any:
    import seqpar

    kw: dict[str, int] = {"sp": case.nproc, "dp": dist.get_world_size() // case.nproc}
    if case.strategy == "hybrid":
        from seqpar.planner import hybrid_split
        from seqpar.train.config import TrainConfig, model_overrides

        heads = model_overrides(TrainConfig(model_config=case.model_config))["num_attention_heads"]
        kw["ulysses"], kw["ring"] = hybrid_split(case.nproc, heads)
    return seqpar.init_mesh(**kw, device_type=device_type)


def bench_worker(rank: int, world: int, case: BenchCase) -> dict[str, float]:
    """One configuration on ``world`` fresh local processes (:func:`seqpar.comm.launch.run_distributed`)."""
    return measure(case, _mesh_for(case, "cpu"), torch.device("cpu"))


def run_case(case: BenchCase, timeout: float = 900.0) -> dict[str, Any]:
    """Measure one case in fresh processes; returns the row (max memory over the ranks)."""
    from seqpar.comm.launch import run_distributed

    per_rank = run_distributed(bench_worker, case.nproc, case, timeout=timeout, pg_timeout=timeout,
                               env={"OMP_NUM_THREADS": "1"})
    return {**asdict(case), "mem_mib": max(r["mem_mib"] for r in per_rank),
            "mem_mib_per_rank": [round(r["mem_mib"], 1) for r in per_rank],
            "step_s": max(r["step_s"] for r in per_rank), "measure": "peak RSS"}


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``mem_ratio`` / ``time_ratio``: each row over the 1-rank row of the same length."""
    single = {r["seq_len"]: r for r in rows if r["nproc"] == 1}
    for r in rows:
        one = single.get(r["seq_len"])
        r["mem_ratio"] = r["mem_mib"] / one["mem_mib"] if one and one["mem_mib"] > 0 else float("nan")
        r["time_ratio"] = r["step_s"] / one["step_s"] if one and one["step_s"] > 0 else float("nan")
    return rows


CSV_FIELDS = ["model", "strategy", "nproc", "seq_len", "tokens_per_rank", "mem_mib", "mem_ratio", "step_s",
              "time_ratio", "mem_mib_per_rank", "measure", "dtype", "steps"]


def write_csv(rows: list[dict[str, Any]], path: str) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "tokens_per_rank": -(-r["seq_len"] // r["nproc"]),
                        "mem_mib": f"{r['mem_mib']:.1f}", "mem_ratio": f"{r['mem_ratio']:.3f}",
                        "step_s": f"{r['step_s']:.4f}", "time_ratio": f"{r['time_ratio']:.3f}",
                        "mem_mib_per_rank": ";".join(str(m) for m in r["mem_mib_per_rank"])})


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Memory per rank and step time against sequence length, one line per (P, strategy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault((r["nproc"], r["strategy"] if r["nproc"] > 1 else "1 rank"), []).append(r)
    for (p, strat), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["seq_len"])
        label = strat if p == 1 else f"P={p} {strat}"
        xs = [r["seq_len"] for r in rs]
        ax_m.plot(xs, [r["mem_mib"] for r in rs], marker="o", label=label)
        ax_t.plot(xs, [r["step_s"] for r in rs], marker="o", label=label)
    for ax, what in ((ax_m, f"peak memory per rank above idle (MiB, {rows[0]['measure']})"),
                     (ax_t, "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'P':>2} {'strategy':<8} {'seq_len':>8} {'mem/rank MiB':>13} {'vs 1 rank':>9} {'step s':>8}"
            f" {'vs 1 rank':>9}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["seq_len"], r["nproc"], r["strategy"])):
        lines.append(f"{r['nproc']:>2} {r['strategy'] if r['nproc'] > 1 else '-':<8} {r['seq_len']:>8} "
                     f"{r['mem_mib']:>13.1f} {r['mem_ratio']:>9.3f} {r['step_s']:>8.3f} {r['time_ratio']:>9.3f}")
    return "\n".join(lines)


def cases(model: str, model_config: str, seq_lens: list[int], nprocs: list[int], strategies: list[str],
          steps: int, dtype: str) -> list[BenchCase]:
    """The 1-rank baseline for every length, then every (P, strategy, length) that applies
    (hybrid needs P >= 4)."""
    out = [BenchCase(model, model_config, 1, "ulysses", n, steps, dtype) for n in seq_lens]
    for p in nprocs:
        if p == 1:
            continue
        for s in strategies:
            if s == "hybrid" and p < 4:
                continue
            out += [BenchCase(model, model_config, p, s, n, steps, dtype) for n in seq_lens]
    return out


def check_cases(all_cases: list[BenchCase]) -> None:
    """Bad input before any process starts: ValueError naming the option."""
    from seqpar.integrations.models import BUILTIN_MODELS

    for c in all_cases:
        if c.model not in BUILTIN_MODELS:
            raise ValueError(f"--model {c.model!r}: seqpar bench takes a built-in config name "
                             f"({', '.join(BUILTIN_MODELS)})")
        if c.seq_len < max(8, 2 * c.nproc):
            raise ValueError(f"--seq-lens {c.seq_len} is too short for {c.nproc} ranks: use >= "
                             f"{max(8, 2 * c.nproc)}")
    if os.cpu_count() and max(c.nproc for c in all_cases) > 64:
        raise ValueError("--nproc above 64 local processes is not what seqpar bench is for: use torchrun")


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
            r = measure(case, _mesh_for(case, device.type), device)
            table = torch.tensor([r["mem_mib"], r["step_s"]], dtype=torch.float64, device=device)
            out = [torch.zeros_like(table) for _ in range(world)]
            dist.all_gather(out, table)
            mems = [float(t[0]) for t in out]
            rows.append({**asdict(case), "mem_mib": max(mems), "mem_mib_per_rank": [round(m, 1) for m in mems],
                         "step_s": max(float(t[1]) for t in out), "measure": "CUDA allocator peak"})
    finally:
        dist.destroy_process_group()
    return rows if int(os.environ.get("RANK", 0)) == 0 else None
