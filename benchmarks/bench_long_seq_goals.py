"""Issue 11's goals, measured with the real memory switches (seqpar.reduce_memory), on the issue's
model: Llama shape, hidden 128, 2 layers, vocabulary 32,000, float32 (tiny-llama at seqpar train's
size with ``vocab_size`` 32000).

    python benchmarks/bench_long_seq_goals.py memory   # peak per rank at 16k tokens, P=2: on vs off
                                                       # (goal <= 0.25x), and step time on / off (<= 1.35x)
    python benchmarks/bench_long_seq_goals.py maxseq   # seqpar bench --max-seq under one cap, P = 1 and 4:
                                                       # switched P=1 >= 4x plain P=1; P=4 >= 4x switched P=1

``memory``: each setting in fresh processes, twice: :func:`seqpar.bench.try_step` (peak resident
memory above the runtime baseline: weights, AdamW states, gradients, activations) and
:func:`seqpar.bench.run_case` (median step time over ``--steps`` timed steps, and the live-tensor peak
of the step above what existed before it). ``maxseq`` runs ``seqpar bench --max-seq`` with the cap and
loss tile given (the defaults keep the search to about ten minutes on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import sys

ISSUE_MODEL = {"vocab_size": 32000}  # over seqpar train's size: hidden 128, MLP 256, 2 layers, 4 heads of 32
ISSUE_MODEL_BUILTIN = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 4, "head_dim": 32, "rope_theta": 1000.0, "vocab_size": 32000}


def memory_goal(seq_len: int, nproc: int, steps: int) -> None:
    from seqpar import bench
    from seqpar.planner.memory import SWITCHES_OFF, SWITCHES_ON

    rows = {}
    for sw in (SWITCHES_OFF, SWITCHES_ON):
        case = bench.BenchCase("tiny-llama", json.dumps(ISSUE_MODEL), nproc, "ulysses", seq_len, steps, switches=sw)
        print(f"  {sw.label}: peak of one step from a fresh process...", file=sys.stderr, flush=True)
        trial = bench.try_step(case, None)
        print(f"  {sw.label}: step time over {steps} steps...", file=sys.stderr, flush=True)
        row = bench.run_case(case)
        rows[sw.label] = (trial, row, bench.estimate(case).device_peak(on_cpu=True) / 2**20)
    print(f"issue 11 model (hidden 128, 2 layers, vocabulary 32000, float32), {seq_len} tokens, P={nproc} ulysses")
    print(f"{'switches':<16} {'peak MiB':>9} {'planner':>8} {'live MiB':>9} {'step s':>8}")
    for label, (trial, row, est) in rows.items():
        print(f"{label:<16} {trial.peak_mib:>9.1f} {est:>8.1f} {row['mem_mib']:>9.1f} {row['step_s']:>8.3f}")
    (t_off, r_off, _), (t_on, r_on, _) = rows["off"], rows["loss+mlp+layers"]
    print(f"peak on/off {t_on.peak_mib / t_off.peak_mib:.3f} (goal <= 0.25); live on/off "
          f"{r_on['mem_mib'] / r_off['mem_mib']:.3f}; step time on/off {r_on['step_s'] / r_off['step_s']:.3f} "
          f"(goal <= 1.35)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("goal", choices=["memory", "maxseq"])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mem-cap", default="320MiB")
    ap.add_argument("--loss-tile", default="256")
    ap.add_argument("--max-seq-nproc", default="1,4")
    ap.add_argument("--switches", default="off,on")
    ap.add_argument("--start", default=None, help="the first length --max-seq tries (default: the planner's)")
    ap.add_argument("--limit", default=str(1 << 22), help="the longest length --max-seq tries (with a limit that "
                    "fits, the answer is 'at least the limit': one trial checks a goal)")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    if args.goal == "memory":
        memory_goal(args.seq_len, args.nproc, args.steps)
        return 0
    from seqpar.cli.main import main as cli

    return cli(["bench", "--max-seq", "--model", "tiny-llama", "--model-config", json.dumps(ISSUE_MODEL_BUILTIN),
                "--mem-cap", args.mem_cap, "--loss-tile", args.loss_tile, "--nproc", args.max_seq_nproc,
                "--strategies", "ulysses", "--switches", args.switches, "--limit", args.limit, "--out", args.out,
                *(["--start", args.start] if args.start else [])])


if __name__ == "__main__":
    sys.exit(main())
