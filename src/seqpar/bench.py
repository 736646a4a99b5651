"""``seqpar bench``: per-rank peak memory and step time of a training step, P ranks vs 1.

One training step (forward, backward, gradient sync, AdamW) of a model on one row of N tokens,
sequence-parallel over P ranks, compared with the same step on one rank -- or, with ``--packing``,
the same row packed with short documents compared with the plain causal row. Memory is what the
step adds on top of what existed after a warm-up step (weights, gradients and optimizer states exist
by then), so the ratio shows how the sequence-length dependent part -- activations -- behaves:

* CPU: the peak of live tensor storage created in one step (:class:`seqpar.testing.memory.LiveMemory`:
  counted, not sampled, so the same on every run), measured on the first, untimed step. The peak
  resident set size of the timed steps is kept beside it (``rss_mib``; each configuration runs in
  fresh worker processes, the peak reset after the baseline with ``/proc/self/clear_refs``).
* CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``) after a reset.

Step time is the median over the timed steps; with more workers than cores (CPU) it measures the
machine's contention, not seqpar.

``--max-seq`` (:func:`max_seq`) measures differently: each trial is one step from fresh processes
(:func:`step_peak`), its peak resident memory counted from the runtime baseline (weights, AdamW states,
gradients and activations all count, as on a GPU), under a per-rank cap a watchdog enforces.
"""

from __future__ import annotations

import gc
import os
import re
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from .planner.memory import SWITCHES_OFF, MemorySwitches

SIZINGS = ("train", "builtin")


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
    doc_len: int = 0  # > 0: the row packs documents of doc_len tokens (position ids restart); 0: one causal row
    switches: MemorySwitches = SWITCHES_OFF  # seqpar.reduce_memory's switches, applied after parallelize
    sizing: str = "train"  # "train": model_config over seqpar train's size; "builtin": over the built-in's own


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

def model_fields(case: BenchCase) -> dict[str, Any]:
    """The config fields a case builds its built-in model with: ``model_config`` over seqpar train's
    size and the copy task's vocabulary (``sizing="train"``), or over the built-in's own config
    (``"builtin"``, e.g. small-llama3's 8,192-token vocabulary). Either way ``model_config`` may set
    ``vocab_size`` (checked by :func:`check_cases` to cover the task's token ids)."""
    import json

    from seqpar.train.config import TrainConfig, model_overrides
    from seqpar.train.tasks import CopyTask

    fields: dict[str, Any] = {"max_position_embeddings": case.seq_len}
    if case.sizing == "train":
        fields["vocab_size"] = CopyTask(max(case.seq_len, CopyTask.min_seq_len)).vocab_size
        return {**fields, **model_overrides(TrainConfig(model=case.model, model_config=case.model_config))}
    model_overrides(TrainConfig(model_config=case.model_config))  # the same JSON checks
    return {**fields, **(json.loads(case.model_config) if case.model_config else {})}


def _build(case: BenchCase, mesh: Any, device: torch.device) -> tuple[Any, Any]:
    import seqpar
    from seqpar.integrations.models import build_model
    from seqpar.train.config import DTYPES

    torch.manual_seed(case.seed)
    model, _ = build_model(case.model, dtype=DTYPES[case.dtype], **model_fields(case))
    model.to(device)
    seqpar.parallelize(model, mesh, strategy=case.strategy)
    if case.switches.any:
        reduce_memory = getattr(seqpar, "reduce_memory", None)
        if reduce_memory is None:
            raise ValueError("this seqpar has no reduce_memory: run without the memory switches")
        reduce_memory(model, mesh, **case.switches.kwargs())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def prepare(case: BenchCase, mesh: Any, device: torch.device) -> tuple[Any, Any]:
    """``(model, optimizer)`` for ``case``, after one small step: gradients and AdamW states exist."""
    from seqpar.train.tasks import CopyTask

    model, opt = _build(case, mesh, device)
    warm = CopyTask(max(CopyTask.min_seq_len, 4 * case.nproc)).row(0)
    _step(model, opt, mesh, {k: v[None].to(device) for k, v in warm.items()}, layout_for(case.strategy))
    return model, opt


def _step(model: Any, opt: Any, mesh: Any, batch: dict[str, torch.Tensor], layout: str) -> None:
    import seqpar

    local = seqpar.shard_batch(batch, mesh, layout=layout)
    model(**local).loss.backward()
    seqpar.sync_gradients(model, mesh)
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench_batch(seq_len: int, doc_len: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row (``[1, seq_len]`` tensors) of the copy task; with ``doc_len`` its ``position_ids``
    restart every ``doc_len`` tokens, so :func:`seqpar.shard_batch` sees packed documents."""
    from seqpar.train.tasks import CopyTask

    batch = {k: v[None] for k, v in CopyTask(seq_len, seed).row(0).items()}
    if doc_len:
        batch["position_ids"] = (torch.arange(seq_len) % doc_len)[None]  # [1, S]
    return batch


def layout_for(strategy: str) -> str:
    """The layout a strategy trains with (as ``seqpar train``): doc-zigzag balances a ring's causal
    work per packed document, Ulysses needs none."""
    return "contiguous" if strategy == "ulysses" else "doc-zigzag"


def probe_step(model: Any, opt: Any, mesh: Any, batch: dict[str, torch.Tensor], layout: str) -> int:
    """Bytes of live tensor storage at the peak of one training step, above what existed before it."""
    from seqpar.testing.memory import LiveMemory

    gc.collect()
    with LiveMemory() as probe:
        _step(model, opt, mesh, batch, layout)
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
        base = _rss_mib()
        reset_ok = _reset_peak_rss()
    times = []
    for _ in range(case.steps + untimed):
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, opt, mesh, batch, layout)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    del model, opt
    step_s = statistics.median(times[untimed:])
    if device.type == "cuda":
        return {"mem_mib": max(0.0, torch.cuda.max_memory_allocated(device) / MIB - base), "step_s": step_s}
    return {"mem_mib": live, "rss_mib": max(0.0, _peak_rss_mib(reset_ok) - base), "step_s": step_s}


# --------------------------------------------------------------------------------------------
# the peak of one step from a fresh process, under a memory cap (seqpar bench --max-seq)
# --------------------------------------------------------------------------------------------

_TINY = '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 128}'
OVER_CAP_EXIT = 86  # a worker's exit code when its watchdog stopped it above the cap


class _RssWatchdog:
    """A thread that ends this process (exit code :data:`OVER_CAP_EXIT`) once its resident set
    exceeds ``limit_bytes``: a step far over the cap stops instead of taking the machine's memory.
    It samples every ``interval`` seconds, so a short spike can slip between samples; the verdict
    is the kernel's exact peak (VmHWM) read after the step, and this is the brake."""

    def __init__(self, limit_bytes: int, interval: float = 0.002) -> None:
        import threading

        self.limit_pages = limit_bytes // os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        with open("/proc/self/statm") as f:
            while not self._stop.wait(interval):
                f.seek(0)
                if int(f.read().split()[1]) > self.limit_pages:
                    os._exit(OVER_CAP_EXIT)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _exact_malloc() -> None:
    """Make glibc hand every freed block of 64 KiB or more back to the system at once (a fixed
    ``M_MMAP_THRESHOLD``; by default glibc raises it to 32 MiB as blocks are freed, then keeps
    freed tiles in its heap), so that the resident peak is the peak of what the step holds.

    64 KiB, not 1 MiB: a tiled step's tiles (``[256, I]`` of an MLP, a layer's q/k/v) are mostly
    under 1 MiB, and in the heap their peak depended on the order torch allocates in. With 1 MiB the
    tiny tiled case of ``test_memory_model`` measured 1.10x its estimate under torch 2.13 and
    1.17-1.31x under 2.15 (same tensors, counted); with 64 KiB both give 0.93x, run after run.
    mmap per block costs the measured step some time (~20% on that tiny case), not its memory."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    except OSError:  # not glibc: its allocator's own behaviour is what gets measured
        pass


def _warm_runtime(case: BenchCase, mesh: Any, device: torch.device) -> None:
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
    With ``cap_bytes`` a watchdog stops the process past the cap (see :class:`_RssWatchdog`).
    Returns MiB: ``peak_mib`` (VmHWM - baseline), ``base_mib``, and ``step_s`` of the measured step."""
    from seqpar.testing.memory import MIB

    device = torch.device("cpu")
    _exact_malloc()
    _warm_runtime(case, mesh, device)
    base = _rss_mib()
    reset_ok = _reset_peak_rss()
    dog = _RssWatchdog(int(base * MIB) + cap_bytes) if cap_bytes is not None else None
    try:
        model, opt = prepare(case, mesh, device)
        batch = bench_batch(case.seq_len, case.doc_len, case.seed)
        dist.barrier()
        t0 = time.perf_counter()
        _step(model, opt, mesh, batch, layout_for(case.strategy))
        step_s = time.perf_counter() - t0
    finally:
        if dog is not None:
            dog.stop()
    return {"peak_mib": _peak_rss_mib(reset_ok) - base, "base_mib": base, "step_s": step_s}


def estimate(case: BenchCase) -> Any:
    """The planner's :class:`seqpar.planner.memory.StepMemory` for ``case``'s model, strategy and
    switches on its most loaded rank (tiles the case leaves open are :func:`seqpar.reduce_memory`'s)."""
    from seqpar.integrations.memory import DEFAULT_LOSS_TILE, DEFAULT_MLP_TILE
    from seqpar.integrations.models import builtin_config
    from seqpar.planner.cost import largest_shard
    from seqpar.planner.memory import step_memory
    from seqpar.train.config import DTYPES

    cfg = builtin_config(case.model, **model_fields(case))
    u, r = (1, case.nproc) if case.strategy == "ring" else (case.nproc, 1)
    if case.strategy == "hybrid":
        from seqpar.planner import hybrid_split

        u, r = hybrid_split(case.nproc, cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return step_memory(tokens=largest_shard(case.seq_len, u, r, zigzag=r > 1), hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                       heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                       vocab_size=cfg.vocab_size, dtype_bytes=DTYPES[case.dtype].itemsize,
                       tied=bool(cfg.tie_word_embeddings), switches=case.switches, loss_tile=DEFAULT_LOSS_TILE,
                       mlp_tile=DEFAULT_MLP_TILE)


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


def max_seq(case: BenchCase, cap_bytes: int, *, start: int, granularity: int, precision: float = 0.125,
            limit: int = 1 << 24, timeout: float = 900.0, log: Any = None) -> tuple[int, list[Trial]]:
    """The longest multiple of ``granularity`` tokens whose full step fits ``cap_bytes`` per rank,
    found by running: from ``start``, double (or halve) until one length fits and one does not,
    then bisect until the gap is below ``precision`` of the fitting length (or one granule).
    Returns ``(longest fitting length or 0, every trial in order)``; ``limit`` bounds the growth
    (the limit itself is tried last, so a fitting limit means "at least the limit")."""
    def run(n: int) -> Trial:
        t = try_step(replace(case, seq_len=n), cap_bytes, timeout)
        trials.append(t)
        if log is not None:
            log(t)
        return t

    trials: list[Trial] = []
    g = granularity
    n = max(g, start // g * g)
    lo, hi = 0, None  # longest that fits, shortest that does not
    if run(n).fits:
        lo = n
        while hi is None and min(2 * lo, limit // g * g) > lo:  # doubling, the limit last
            grow = min(2 * lo, limit // g * g)
            if run(grow).fits:
                lo = grow
            else:
                hi = grow
        if hi is None:
            return lo, trials
    else:
        hi = n
        while lo == 0 and hi > g:
            n = max(g, hi // 2 // g * g)
            if run(n).fits:
                lo = n
            else:
                hi = n
        if lo == 0:
            return 0, trials
    while hi - lo > max(g, precision * lo):
        mid = (lo + hi) // 2 // g * g
        if run(mid).fits:
            lo = mid
        else:
            hi = mid
    return lo, trials


def mesh_for(case: BenchCase, device_type: str) -> Any:
    """The mesh a case runs on: ``sp = nproc`` (hybrid: split into ulysses x ring), the rest dp."""
    import seqpar

    kw: dict[str, int] = {"sp": case.nproc, "dp": dist.get_world_size() // case.nproc}
    if case.strategy == "hybrid":
        from seqpar.integrations.models import builtin_config
        from seqpar.planner import hybrid_split

        heads = builtin_config(case.model, **model_fields(case)).num_attention_heads
        kw["ulysses"], kw["ring"] = hybrid_split(case.nproc, heads)
    return seqpar.init_mesh(**kw, device_type=device_type)


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


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``mem_ratio`` / ``time_ratio``: each row over the 1-rank row of the same length."""
    single = {r["seq_len"]: r for r in rows if r["nproc"] == 1}
    for r in rows:
        one = single.get(r["seq_len"])
        r["mem_ratio"] = _ratio(r["mem_mib"], one["mem_mib"]) if one else float("nan")
        r["time_ratio"] = _ratio(r["step_s"], one["step_s"]) if one else float("nan")
    return rows


def add_packing_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``mem_ratio`` / ``time_ratio``: each row over the plain row of the same P, strategy and
    length (1 for the plain row itself); ``growth``: its memory over the same series' at half the
    length (nan where that was not measured) -- 2 where memory is linear in S, 4 where quadratic."""
    by = {(r["nproc"], r["strategy"], r["seq_len"], r["doc_len"]): r for r in rows}
    nan = float("nan")
    for r in rows:
        plain = by.get((r["nproc"], r["strategy"], r["seq_len"], 0))
        half = by.get((r["nproc"], r["strategy"], r["seq_len"] // 2, r["doc_len"])) if r["seq_len"] % 2 == 0 else None
        r["mem_ratio"] = _ratio(r["mem_mib"], plain["mem_mib"]) if plain else nan
        r["time_ratio"] = _ratio(r["step_s"], plain["step_s"]) if plain else nan
        r["growth"] = _ratio(r["mem_mib"], half["mem_mib"]) if half else nan
    return rows


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


def packing_cases(model: str, model_config: str, seq_lens: list[int], nprocs: list[int], strategies: list[str],
                  steps: int, dtype: str, doc_len: int) -> tuple[list[BenchCase], list[str]]:
    """Every (P, strategy, length) twice: one causal row, and the row packed with ``doc_len``-token
    documents. Also returns what was left out and why (hybrid below P = 4, P = 1)."""
    out, skipped = [], []
    for p in nprocs:
        if p == 1:
            skipped.append("P=1: the packing table compares sequence-parallel strategies; use --nproc >= 2")
            continue
        for s in strategies:
            if s == "hybrid" and p < 4:
                skipped.append(f"hybrid at P={p}: it splits the ranks into ulysses x ring, each >= 2, so it needs "
                               "P >= 4 (add --nproc 4)")
                continue
            out += [BenchCase(model, model_config, p, s, n, steps, dtype, doc_len=d)
                    for n in seq_lens for d in (0, doc_len)]
    return out, skipped


def check_cases(all_cases: list[BenchCase]) -> None:
    """Bad input before any process starts: ValueError naming the option."""
    from seqpar.integrations.models import BUILTIN_MODELS, builtin_config
    from seqpar.train.tasks import CopyTask

    for c in all_cases:
        if c.model not in BUILTIN_MODELS:
            raise ValueError(f"--model {c.model!r}: seqpar bench takes a built-in config name "
                             f"({', '.join(BUILTIN_MODELS)})")
        if c.seq_len < max(8, 2 * c.nproc):
            raise ValueError(f"--seq-lens {c.seq_len} is too short for {c.nproc} ranks: use >= "
                             f"{max(8, 2 * c.nproc)}")
        if c.sizing not in SIZINGS:
            raise ValueError(f"sizing {c.sizing!r}: choose one of {SIZINGS}")
        need = CopyTask(max(c.seq_len, CopyTask.min_seq_len)).vocab_size
        vocab = model_fields(c).get("vocab_size") or builtin_config(c.model).vocab_size
        if vocab < need:
            raise ValueError(f"--model-config vocab_size {vocab} is smaller than the {need} token ids of the bench's "
                             f"copy task: use vocab_size >= {need}")
        if c.doc_len and not 2 <= c.doc_len < c.seq_len:
            raise ValueError(f"--packing {c.doc_len}: a packed row needs documents of 2 to seq_len - 1 tokens; "
                             f"use a smaller --packing or longer --seq-lens than {c.seq_len}")
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
