"""``seqpar train --sp-schedule dynamic`` vs static on a long-tailed JSONL: step time and loss curve.

    python benchmarks/bench_dynamic_train.py          # ~4 min on 2 shared cores

The job users run, not a loop of the benchmark's own: 4 gloo ranks, sp=4, the built-in tiny Llama at
the defaults (tiled loss and MLP, layer checkpoints), float32, a JSONL of documents with lognormal
lengths (mean ~512 tokens, capped at 8k, fixed seed), ``--packing`` into rows of ``--seq-len 8192``,
``--micro-batch 3`` (about 25k tokens per step). Both schedules train on the same rows in the same
steps; the dynamic one bins each packed row's documents apart (short ones at degree 1) with the
default token budget (``seq-len / sp`` per rank per bin, the static shard). Runs go static, dynamic,
dynamic, static (a burst of other load hits both); the ratio is the median dynamic step over the
median static step (each from metrics.jsonl's ``step_time_s``, the first step of each run left out:
it warms up), beside the largest relative difference of the two loss curves (float32 rounding).

Measured on 2 shared CPU cores (2026-12-06, load 1.9 before / 3.6 after): 0.883x (static 1.72 s,
dynamic 1.52 s per step, medians over 14 steps), the 8 losses equal to 9.5e-8 relative; documents
at sp=1/2/4: 346/10/43; the cost model measured in 16 s. A run with 4 steps beside other load: 0.935x.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

from seqpar.planner.gain import lognormal_lengths
from seqpar.train import TrainConfig
from seqpar.train.job import prepare_job
from seqpar.train.launcher import run_local

SEQ_LEN = 8192


def write_jsonl(path: Path, docs: int, seed: int) -> list[int]:
    """``docs`` texts of lognormal length (bytes; a document is its bytes plus BOS and EOS)."""
    lengths = lognormal_lengths(docs, mean=512, cap=SEQ_LEN - 2, seed=seed)
    rng = random.Random(seed)
    with open(path, "w") as f:
        for n in lengths:
            f.write(json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(n))}) + "\n")
    return lengths


def step_times(metrics: str) -> list[float]:
    with open(metrics) as f:
        return [m["step_time_s"] for m in map(json.loads, f) if "step_time_s" in m][1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    args = ap.parse_args()
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lengths = write_jsonl(root / "long_tailed.jsonl", 400, seed=37)
        base = TrainConfig(data=[str(root / "long_tailed.jsonl")], seq_len=SEQ_LEN, packing=True, sp=4, micro_batch=3,
                           grad_accum=1, steps=args.steps, lr=1e-3, warmup=1, dtype="float32", eval_rows=0,
                           progress=False, plot=False, seed=1, save_every=0)
        runs: dict[str, list] = {"static": [], "dynamic": []}
        for i, name in enumerate(("static", "dynamic", "dynamic", "static")):
            cfg = base.replace(sp_schedule=name, save_dir=str(root / f"{name}{i}"))
            runs[name].append(run_local(prepare_job(cfg)))
        times = {name: [t for s in ss for t in step_times(s.metrics)] for name, ss in runs.items()}
    losses = {name: [loss for _, loss in ss[0].losses] for name, ss in runs.items()}
    repeat = max(abs(a - b) / abs(a) for a, b in zip(losses["static"], [loss for _, loss in runs["static"][1].losses],
                                                      strict=True))
    diff = max(abs(a - b) / abs(a) for a, b in zip(losses["static"], losses["dynamic"], strict=True))
    degrees = runs["dynamic"][0].sp_degrees
    ratio = statistics.median(times["dynamic"]) / statistics.median(times["static"])
    print(f"data: {len(lengths)} documents, {sum(lengths) + 2 * len(lengths)} tokens (mean "
          f"{statistics.mean(lengths) + 2:.0f}, max {max(lengths) + 2}), packed into rows of {SEQ_LEN}; "
          f"{runs['static'][0].tokens_per_step} tokens per step, 4 ranks, sp=4")
    for name in ("static", "dynamic"):
        print(f"{name:<8} step time median {statistics.median(times[name]):.3f}s over {len(times[name])} steps "
              f"(range {min(times[name]):.3f}-{max(times[name]):.3f}s); losses "
              + ", ".join(f"{x:.5f}" for x in losses[name]))
    print("dynamic: documents at sp=" + "/".join(map(str, degrees)) + ": " + "/".join(map(str, degrees.values())))
    print(f"dynamic's cost model: {runs['dynamic'][0].sp_cost}")
    print(f"dynamic / static step time: {ratio:.3f}x; loss curves differ by at most {diff:.2g} relative "
          f"(float32; static run against itself: {repeat:.2g})")
    print(f"load average (1 min) before / after: {before:.1f} / {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
