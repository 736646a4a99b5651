"""seqpar against DeepSpeed's ALST (Arctic Long Sequence Training), the same model, row and machine,
in one run (issue 48): exactness of both against the unsharded model, per-rank peak memory (RSS and
live tensors) and step time at equal S, and the longest S each fits under the same per-rank cap.

    python benchmarks/bench_alst.py                    # P = 2 and 4 on gloo, float32, S = 4k/8k/16k, cap 256 MiB
    python benchmarks/bench_alst.py --seq-lens 16384,32768,65536 --cap 512MiB --limit 131072   # issue 48's grid
    DS_BUILD_OPS=0 pip install deepspeed==0.19.8       # the peer (without it seqpar runs alone, and says so)

The default run takes about 15 minutes on 2 idle cores (a 16k-token step of this model is about a
minute of the machine; issue 48's grid is hours here, minutes on a GPU).

The model (``--width``): Llama-3's proportions (MLP 3.5 x hidden, vocabulary 32 x hidden, 4 query
heads per KV head, untied head, RoPE theta 500k), 8 layers. ``issue`` is issue 48's size (hidden
1024, vocabulary 32,768); the default ``quarter`` is the same model at a quarter of the width
(hidden 256, vocabulary 8,192): on this CPU a 16k-token step of the issue's size takes minutes, and
the run has about ten such steps per system. ``llama3-8b`` is Llama-3-8B's layers (for a GPU).

seqpar: ``parallelize`` (Ulysses) + ``reduce_memory`` (tiled loss, tiled MLP, checkpoints with
offload -- on a CPU plain checkpoints: the inputs already live in host memory). ALST:
:mod:`seqpar.bench.alst` (its five parts as DeepSpeed's tutorial and ArcticTraining set them up;
what cannot run on a CPU is said there). Both: AdamW, gradients averaged over the ranks.

Every figure is one training step in fresh processes (:func:`seqpar.bench.peak.measured_step`):
RSS = the peak resident set above the runtime baseline (weights, gradients, AdamW states and the
step's activations), live = the peak of tensor storage the step itself creates (counted, not
sampled; :class:`seqpar.bench.census.PeakCensus`, which also sorts the bytes at that peak by tensor
kind), step = that step's wall time (with the probe on, for both), cpu = its CPU time (the work,
which other jobs on a shared machine disturb less than the wall time).
The longest S: :func:`seqpar.bench.search.max_seq` per system and P -- the memory model's estimate to
start, doubling, bisection to 1/8, every trial a fresh step under the cap (a watchdog ends a rank
past it); lengths the equal-S grid already measured are reused, not rerun.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from typing import Any

WIDTHS = {
    "quarter": dict(hidden_size=256, intermediate_size=896, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                    vocab_size=8192),
    "issue": dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, vocab_size=32768),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=128256),
}
COMMON = dict(rope_theta=500000.0, tie_word_embeddings=False, attention_dropout=0.0)
GRANULE = 512  # every length tried is a multiple of 512 tokens (and so of P)


def model_config(width: str, layers: int) -> str:
    return json.dumps({**WIDTHS[width], **COMMON, "num_hidden_layers": layers})


def parse_bytes(text: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}
    t = text.strip().lower()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


class Runner:
    """Every trial of one run, cached by (system, P, S): the equal-S grid's steps serve the search."""

    def __init__(self, base: Any, cap: int, have_alst: bool, log: Any, device: str = "cpu") -> None:
        from seqpar.bench.alst import alst_cuda_worker, alst_peak_worker
        from seqpar.bench.side_by_side import seqpar_cuda_worker, seqpar_peak_worker

        self.base, self.cap, self.log, self.device = base, cap, log, device
        cuda = device == "cuda"
        self.workers = {"seqpar": seqpar_cuda_worker if cuda else seqpar_peak_worker}
        if have_alst:
            self.workers["alst"] = alst_cuda_worker if cuda else alst_peak_worker
        self.done: dict[tuple[str, int, int], Any] = {}

    def trial(self, system: str, nproc: int, seq: int, live: bool | str = False, capped: bool = False) -> Any:
        """One step (or the one already run at this length); ``capped``: under the cap's watchdog
        (the search), else measured whole (the equal-S grid)."""
        from seqpar.bench import try_step

        key = (system, nproc, seq)
        old = self.done.get(key)
        measured = old is not None and (not live or old.live_mib == old.live_mib)
        if measured and (live != "census" or old.census is not None):
            t = old
        else:
            t0 = time.time()
            cpu = self.device == "cpu"
            t = try_step(replace(self.base, nproc=nproc, seq_len=seq), self.cap if cpu and capped else None,
                         timeout=1800, live=live if cpu else False, worker=self.workers[system])
            fits = t.peak_mib == t.peak_mib and t.peak_mib * 2**20 <= self.cap
            self.log(f"  {system:<6} P={nproc} S={seq:>6}: peak {t.peak_mib:8.1f} MiB  live {t.live_mib:8.1f} MiB  "
                     f"step {t.step_s:7.2f} s  cpu {t.cpu_s:7.2f} s  {'under' if fits else 'over'} the cap  "
                     f"({time.time() - t0:.0f} s, load {loadavg()})")
            self.done[key] = t
        fits = t.peak_mib == t.peak_mib and t.peak_mib * 2**20 <= self.cap
        return replace(t, fits=fits)


def estimate_mib(system: str, case: Any) -> float:
    """The memory model's peak for ``case`` (MiB): seqpar's planner model (the larger of its loss and
    backward phases, offloaded inputs staying in the same memory on a CPU), or ALST's."""
    from seqpar import bench
    from seqpar.integrations.models import builtin_config
    from seqpar.planner.memory_alst import alst_step_memory
    from seqpar.train.config import DTYPES

    if system == "seqpar":
        return bench.estimate(case).phase_peak(on_cpu=True) / 2**20
    cfg = builtin_config(case.model, **bench.model_fields(case))
    return alst_step_memory(tokens=case.seq_len // case.nproc, hidden_size=cfg.hidden_size,
                            intermediate_size=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                            vocab_size=cfg.vocab_size, ulysses=case.nproc, dtype_bytes=DTYPES[case.dtype].itemsize,
                            tied=bool(cfg.tie_word_embeddings)).total / 2**20


def exactness(base: Any, nprocs: list[int], seq: int, have_alst: bool, log: Any) -> dict[int, dict]:
    """Both systems' loss and gradients against the unsharded model, float64, at ``seq`` tokens."""
    from seqpar.bench.side_by_side import exactness_worker
    from seqpar.comm.launch import run_distributed

    out = {}
    for p in nprocs:
        case = replace(base, nproc=p, seq_len=seq, dtype="float64")
        per_rank = run_distributed(exactness_worker, p, case, have_alst, timeout=900, env={"OMP_NUM_THREADS": "1"})
        out[p] = {s: max((r[s] for r in per_rank), key=lambda e: e["grad_err"]) for s in per_rank[0]}
        for s, e in out[p].items():
            log(f"  {s:<6} P={p} S={seq}: |loss - unsharded| {e['loss_err']:.1e} (loss {e['loss']:.4f})  "
                f"max |grad - unsharded| {e['grad_err']:.1e} (largest gradient {e['grad_max']:.1e}), "
                f"at {e['worst']}: |grad| / |unsharded| {e['scale']:.4g}")
    return out


def attribution(base: Any, runner: Runner, nproc: int, seq: int, systems: list[str], log: Any) -> None:
    """The bytes at each system's live peak by tensor kind (:mod:`seqpar.bench.census`), beside the
    parameters and AdamW states (counted) and what RSS holds beyond them (allocator, kernels' scratch)."""
    import torch

    from seqpar.bench import model_fields
    from seqpar.bench.census import KINDS, attribute
    from seqpar.integrations.models import build_model

    fields = model_fields(replace(base, seq_len=seq))
    with torch.device("meta"):
        model, _ = build_model(base.model, **fields)
    shapes = [(tuple(p.shape), "float32") for p in model.parameters()]
    params = sum(p.numel() for p in model.parameters()) * 4
    cfg = model.config
    rows = {}
    for s in systems:
        t = runner.done[(s, nproc, seq)]
        kinds = attribute(t.census or {}, vocab=cfg.vocab_size, hidden=cfg.hidden_size, mlp=cfg.intermediate_size,
                          param_shapes=shapes)
        rows[s] = {"parameters": params, "AdamW states": 2 * params, **kinds,
                   "RSS beyond (allocator, scratch)": int(t.peak_mib * 2**20) - 3 * params - int(t.live_mib * 2**20),
                   "peak RSS": int(t.peak_mib * 2**20)}
    log(f"\nbytes at the peak per rank, P={nproc}, S={seq} (MiB; live tensors by kind at the live peak):")
    log(f"  {'kind':<34}" + "".join(f"{s:>10}" for s in systems))
    for k in ["parameters", "AdamW states", *KINDS, "RSS beyond (allocator, scratch)", "peak RSS"]:
        log(f"  {k:<34}" + "".join(f"{rows[s][k] / 2**20:>10.1f}" for s in systems))


def ratio(a: float, b: float) -> float:
    return a / b if b and a == a and b == b else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", default="2,4", help="P values (comma-separated)")
    ap.add_argument("--seq-lens", default="4096,8192,16384", help="the equal-S grid (issue 48's: 16384,32768,65536, "
                    "hours on this CPU)")
    ap.add_argument("--cap", default="256MiB", help="per-rank memory cap of the longest-S search (above the "
                    "runtime baseline: weights, gradients, AdamW states and activations count)")
    ap.add_argument("--width", choices=list(WIDTHS), default="quarter")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--exact-seq", type=int, default=512, help="tokens of the float64 exactness check (0: skip)")
    ap.add_argument("--limit", type=int, default=24576, help="the longest S the search tries (a fitting limit "
                    "reads \"at least the limit\")")
    ap.add_argument("--no-search", action="store_true")
    ap.add_argument("--json", default=None, help="also write every trial (figures and censuses) to this file")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one process on this GPU (P = 1; "
                    "peaks from the CUDA allocator, the cap defaults to the GPU's memory)")
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        args.nproc, args.exact_seq = "1", 0
        if args.cap == ap.get_default("cap"):
            args.cap = str(int(torch.cuda.get_device_properties(0).total_memory * 0.95))
    from seqpar import bench
    from seqpar.bench.alst import INSTALL, deepspeed_version
    from seqpar.planner.memory import MemorySwitches

    t_start = time.time()

    def log(msg: str) -> None:
        print(msg, flush=True)

    nprocs = [int(p) for p in args.nproc.split(",")]
    grid = [int(s) for s in args.seq_lens.split(",")]
    cap = parse_bytes(args.cap)
    version = deepspeed_version()
    systems = ["seqpar", "alst"] if version else ["seqpar"]
    switches = MemorySwitches(tiled_loss=True, tiled_mlp=True, checkpoint="offload")  # reduce_memory's long-S set
    base = bench.BenchCase("tiny-llama", model_config(args.width, args.layers), nprocs[0], "ulysses", grid[0],
                           dtype=args.dtype, sizing="builtin", switches=switches)
    w = WIDTHS[args.width]
    log(f"model: Llama-shaped, hidden {w['hidden_size']}, MLP {w['intermediate_size']}, {args.layers} layers, "
        f"{w['num_attention_heads']}/{w['num_key_value_heads']} heads of {w['head_dim']}, vocabulary "
        f"{w['vocab_size']}, {args.dtype}, random init; one row of S random tokens, every token a target")
    log(f"seqpar: parallelize(ulysses) + reduce_memory({switches.label}); ALST: deepspeed {version or '-'}: "
        "UlyssesSPAttentionHF, TiledMLP, TiledFusedLogitsLoss, checkpoints + offload ctx, UlyssesSPDataLoaderAdapter")
    if version:
        log("ALST parts not run here: ZeRO-3 and its CPU optimizer offload (the optimizer side, the same AdamW "
            "for both), Liger-kernel (Triton, GPU only: ALST's fallback is the TiledFusedLogitsLoss above); "
            "the checkpoint offload runs but moves nothing on a CPU (the inputs already live in host memory)")
    else:
        log(f"deepspeed is not installed: seqpar runs alone. For the side-by-side run: {INSTALL}")
    log(f"machine: {os.cpu_count()} CPUs, load average {loadavg()} at the start")
    if args.exact_seq:
        log(f"\nexactness against the unsharded model (float64, S={args.exact_seq}):")
        exactness(base, nprocs, args.exact_seq, bool(version), log)
    runner = Runner(base, cap, bool(version), log, args.device)
    log("\nequal S (one step each, fresh processes; peak = RSS above the runtime baseline):")
    for p in nprocs:
        for s in grid:
            for system in systems:
                runner.trial(system, p, s, live="census")
    for p in nprocs if args.device == "cpu" else []:
        attribution(base, runner, p, grid[-1], systems, log)
    longest: dict[tuple[str, int], int] = {}
    if not args.no_search:
        log(f"\nlongest S under {args.cap} per rank (estimate to start, doubling, bisection to 1/8; "
            f"multiples of {GRANULE}, at most {args.limit}):")
        for p in nprocs:
            for system in systems:
                case = replace(base, nproc=p)
                start = bench.predicted_max(case, cap, GRANULE, args.limit,
                                            peak_bytes=lambda c, s=system: int(estimate_mib(s, c) * 2**20))
                start = min(grid, key=lambda g: abs(math.log(g / max(start, GRANULE))))  # a measured length
                n, trials = bench.max_seq(case, cap, start=start, granularity=GRANULE, limit=args.limit,
                                          trial=lambda c, s=system: runner.trial(s, c.nproc, c.seq_len, capped=True))
                longest[(system, p)] = n
                log(f"  {system:<6} P={p}: {n} tokens ({len(trials)} trials: "
                    f"{', '.join(f'{t.seq_len}{chr(10003) if t.fits else chr(10007)}' for t in trials)})")
    report(runner, nprocs, grid, systems, longest, log)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"system": k[0], "nproc": k[1], "seq_len": k[2], "peak_mib": t.peak_mib, "live_mib": t.live_mib,
                        "step_s": t.step_s, "cpu_s": t.cpu_s,
                        "census": [[*map(str, key), n] for key, n in (t.census or {}).items()]}
                       for k, t in runner.done.items()], f)
    log(f"\n(total {time.time() - t_start:.0f} s; load average {loadavg()} at the end)")
    if version:
        peak = [ratio(runner.done[("seqpar", p, s)].peak_mib, runner.done[("alst", p, s)].peak_mib)
                for p in nprocs for s in grid]
        step = [ratio(sum(runner.done[("seqpar", p, s)].step_s for s in grid),
                      sum(runner.done[("alst", p, s)].step_s for s in grid)) for p in nprocs]
        far = [ratio(longest.get(("seqpar", p), 0), longest.get(("alst", p), 0)) for p in nprocs]
        log(f"seqpar / ALST: longest S at the cap {min(far, default=float('nan')):.2f}x, peak per rank at equal S "
            f"{max(peak):.2f}x, step time {max(step):.2f}x")
    return 0


def report(runner: Runner, nprocs: list[int], grid: list[int], systems: list[str],
           longest: dict[tuple[str, int], int], log: Any) -> None:
    """The table: per P and S, each system's figures, the memory models' predictions, the ratios."""
    log("\nper rank (max over ranks); model = the memory model's peak / measured peak RSS:")
    log(f"  {'P':>2} {'S':>6}  {'system':<6} {'peak MiB':>9} {'model':>6} {'live MiB':>9} {'step s':>8} {'cpu s':>7}")
    for p in nprocs:
        for s in grid:
            for system in systems:
                t = runner.done[(system, p, s)]
                est = estimate_mib(system, replace(runner.base, nproc=p, seq_len=s))
                log(f"  {p:>2} {s:>6}  {system:<6} {t.peak_mib:>9.1f} {ratio(est, t.peak_mib):>6.2f} "
                    f"{t.live_mib:>9.1f} {t.step_s:>8.2f} {t.cpu_s:>7.2f}")
            if len(systems) == 2:
                a, b = runner.done[("seqpar", p, s)], runner.done[("alst", p, s)]
                log(f"  {p:>2} {s:>6}  seqpar / ALST: peak {ratio(a.peak_mib, b.peak_mib):.2f}x  live "
                    f"{ratio(a.live_mib, b.live_mib):.2f}x  step {ratio(a.step_s, b.step_s):.2f}x  cpu "
                    f"{ratio(a.cpu_s, b.cpu_s):.2f}x")
    for p in nprocs:
        if ("seqpar", p) in longest and ("alst", p) in longest:
            log(f"  P={p}: longest S seqpar {longest[('seqpar', p)]}, ALST {longest[('alst', p)]}: "
                f"{ratio(longest[('seqpar', p)], longest[('alst', p)]):.2f}x")
    if len(systems) == 2:
        for p in nprocs:
            mine, theirs = ([runner.done[(s_, p, s)] for s in grid] for s_ in systems)
            log(f"  P={p}: the grid's total step time seqpar / ALST "
                f"{ratio(sum(t.step_s for t in mine), sum(t.step_s for t in theirs)):.2f}x, "
                f"CPU time {ratio(sum(t.cpu_s for t in mine), sum(t.cpu_s for t in theirs)):.2f}x")
        log("summary, the worst over P (and S for the peak): longest S the smallest ratio, peak the largest, "
            "step time the largest of the grid's total step time per P")


if __name__ == "__main__":
    sys.exit(main())
