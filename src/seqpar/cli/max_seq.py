"""``seqpar bench --max-seq``: the longest sequence whose full training step (forward, backward,
AdamW) fits a per-rank memory cap, for each P and each set of memory switches, found by running.

Each trial is one fresh set of worker processes (:func:`seqpar.bench.peak.try_step`): the cap counts the
resident memory a rank adds above its runtime baseline (torch and the process group loaded, the code
paths warmed on a tiny model) -- the model's weights, AdamW states, gradients and activations, as a
GPU's memory would hold them. A watchdog ends a rank that crosses the cap; the verdict is the kernel's
exact peak (VmHWM). (``RLIMIT_AS`` is no cap here: it bounds address space, not memory -- 755 MiB
virtual for 344 MiB resident with torch, transformers and a tiny model, plus 64 MiB of reserved malloc
arena per thread -- so it refuses steps that fit.) The search starts where the planner's memory
model says the cap is reached, then doubles or halves until it brackets the answer and bisects to
``--precision``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .tables import num, write_csv

SWITCH_PARTS = ("loss", "mlp", "layers", "offload")


def parse_switches(text: str, loss_tile: int | None = None, mlp_tile: int | None = None) -> list[Any]:
    """``"off,on"`` -> switch sets. Each item: ``off``, ``on`` (tiled loss, tiled MLP, checkpointed
    layers) or parts joined by ``+`` from loss, mlp, layers, offload (e.g. ``loss+offload``). The
    tiles (tokens; None: the library's defaults) apply to every set that tiles."""
    from seqpar.planner.memory import MemorySwitches

    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        presets = {"off": [], "on": ["loss", "mlp", "layers"]}
        parts = presets[item] if item in presets else item.split("+")
        bad = [p for p in parts if p not in SWITCH_PARTS] + (["layers+offload"] if {"layers", "offload"} <= set(parts)
                                                             else [])
        if bad:
            raise ValueError(f"--switches {text!r}: {bad[0]!r} is not a switch; use off, on, or parts joined by + from "
                             f"{', '.join(SWITCH_PARTS)} (layers and offload exclude each other)")
        mode = "offload" if "offload" in parts else "layers" if "layers" in parts else "none"
        out.append(MemorySwitches(tiled_loss="loss" in parts, tiled_mlp="mlp" in parts, checkpoint=mode,
                                  loss_tile=loss_tile if "loss" in parts else None,
                                  mlp_tile=mlp_tile if "mlp" in parts else None))
    if not out:
        raise ValueError(f"--switches {text!r}: give at least one, e.g. off,on")
    return out


def run_max_seq(args: argparse.Namespace, strategies: list[str], nprocs: list[int]) -> int:
    from seqpar import bench
    from seqpar.planner import format_bytes

    switch_sets = parse_switches(args.switches, args.loss_tile, args.mlp_tile)
    if args.mem_cap < 2**20:
        raise ValueError(f"--mem-cap {args.mem_cap} bytes is below 1 MiB: give e.g. 2GiB")
    if not 0 < args.precision < 1:
        raise ValueError(f"--precision must be between 0 and 1 (a fraction of the length), got {args.precision}")
    model = args.model or "small-llama3"
    cases = [bench.BenchCase(model, args.model_config, p, s if p > 1 else "ulysses", 64 * p, 1, args.dtype,
                             switches=sw, sizing="builtin")
             for sw in switch_sets for p in nprocs for s in (strategies if p > 1 else strategies[:1])
             if not (s == "hybrid" and p < 4)]
    if not cases:
        raise ValueError("nothing to measure: hybrid needs --nproc 4 or more")
    bench.check_cases(cases)
    rows, trials = [], []
    for case in cases:
        g = 64 * case.nproc
        guess = bench.predicted_max(case, args.mem_cap, g, args.limit)
        where = f"P={case.nproc} {case.strategy if case.nproc > 1 else '':<7} switches {case.switches.label}"
        print(f"  {where}: planner predicts {guess} tokens under {format_bytes(args.mem_cap)}; searching...",
              file=sys.stderr, flush=True)

        def log(t: Any, where: str = where) -> None:
            verdict = "fits" if t.fits else ("stopped" if t.stopped else "over")
            peak = "-" if t.stopped else f"{t.peak_mib:.0f} MiB"
            print(f"    {where} seq_len={t.seq_len}: {verdict} ({peak})", file=sys.stderr, flush=True)

        start = args.start // g * g if args.start else guess
        best, tried = bench.max_seq(case, args.mem_cap, start=max(start, g), granularity=g,
                                    precision=args.precision, limit=args.limit, timeout=args.timeout, log=log)
        at = next((t for t in reversed(tried) if t.fits and t.seq_len == best), None)
        rows.append({"model": model, "strategy": case.strategy, "nproc": case.nproc, "switches": case.switches.label,
                     "max_seq": best, "predicted": guess, "peak_mib": at.peak_mib if at else float("nan"),
                     "step_s": at.step_s if at else float("nan"), "cap_mib": args.mem_cap / 2**20,
                     "trials": len(tried), "dtype": args.dtype, "model_config": args.model_config})
        trials += [{"nproc": case.nproc, "strategy": case.strategy, "switches": case.switches.label,
                    "seq_len": t.seq_len, "fits": t.fits, "stopped": t.stopped, "peak_mib": t.peak_mib,
                    "step_s": t.step_s} for t in tried]
    bench.add_max_seq_ratios(rows)
    os.makedirs(args.out, exist_ok=True)
    csv_path, png_path = os.path.join(args.out, "bench_max_seq.csv"), os.path.join(args.out, "bench_max_seq.png")
    write_csv(rows, csv_path, MAX_SEQ_FIELDS)
    write_csv(trials, os.path.join(args.out, "bench_max_seq_trials.csv"), TRIAL_FIELDS)
    plot_max_seq(rows, png_path, f"seqpar bench --max-seq: {model} {args.dtype}, cap "
                 f"{format_bytes(args.mem_cap)} per rank")
    print(format_max_seq_table(rows))
    print(f"\nmax_seq = longest sequence (multiple of 64 x P) whose full step fitted {format_bytes(args.mem_cap)} per "
          f"rank above the runtime baseline, to {args.precision:.0%}; x off = over the same P without switches; "
          f"x P=1 = over P=1 with the same switches")
    print(f"wrote {os.path.abspath(csv_path)} and {os.path.abspath(png_path)}")
    return 0


MAX_SEQ_FIELDS = ["model", "strategy", "nproc", "switches", "max_seq", "vs_off", "vs_p1", "predicted", "peak_mib",
                  "step_s", "cap_mib", "trials", "dtype", "model_config"]
TRIAL_FIELDS = ["nproc", "strategy", "switches", "seq_len", "fits", "stopped", "peak_mib", "step_s"]


def format_max_seq_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'P':>2} {'strategy':<8} {'switches':<18} {'max_seq':>8} {'x off':>6} {'x P=1':>6} {'planner':>8} "
            f"{'peak MiB':>9} {'step s':>7}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["switches"] != "off", r["switches"], r["nproc"], r["strategy"])):
        lines.append(f"{r['nproc']:>2} {r['strategy'] if r['nproc'] > 1 else '-':<8} {r['switches']:<18} "
                     f"{r['max_seq']:>8} {num(r['vs_off'], '.2f', 6)} {num(r['vs_p1'], '.2f', 6)} "
                     f"{r['predicted']:>8} {num(r['peak_mib'], '.0f', 9)} {num(r['step_s'], '.2f', 7)}")
    return "\n".join(lines)


def plot_max_seq(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Longest sequence against P, one line per (switches, strategy); the planner's prediction dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault((r["switches"], r["strategy"]), []).append(r)
    for (sw, strat), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["nproc"])
        line, = ax.plot([r["nproc"] for r in rs], [max(r["max_seq"], 1) for r in rs], marker="o",
                        label=f"{sw} ({strat})")
        ax.plot([r["nproc"] for r in rs], [max(r["predicted"], 1) for r in rs], linestyle=":",
                color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("P (ranks sharing the sequence)")
    ax.set_ylabel("longest sequence that trains (tokens)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title="switches (dotted: planner)", title_fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
