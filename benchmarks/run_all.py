"""``make bench``: every benchmark of the repository, one after the other, each printing its ratios.

    python benchmarks/run_all.py            # strategies, vs DeepSpeed-Ulysses, the guard's cost, the fault channel's
                                            # cost, the seeded fuzz's counts, the soak's slopes, seqpar bench,
                                            # seqpar bench --packing (plain vs packed rows), issue 11's goals
                                            # (memory switches: peak, step time, seqpar bench --max-seq),
                                            # a ring step vs SDPA alone, one rank of P (issue 27),
                                            # DPO / GRPO steps' memory at sp=1 vs sp=4 (issue 36),
                                            # expert parallelism: ep = 1, 2, 4 at sp = 4 (issue 46),
                                            # tp2 x sp2 vs sp4 vs tp4 at 4 ranks (issue 46)
                                            # a diffusion transformer vs diffusers' own Ulysses (issue 47)
                                            # seqpar vs DeepSpeed's ALST: longest S, peak, step time (issue 48)
    python benchmarks/run_all.py --quick    # smaller sizes (a few minutes on 2 cores)

The peer comparisons run seqpar alone when DeepSpeed is not installed (they say so).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _kernel_args(quick: bool) -> list[str]:
    """bench_kernels' sizes: its defaults on a GPU, a CPU-sized run otherwise."""
    import torch

    if torch.cuda.is_available():
        return ["--seq", "8192,16384"] if quick else []
    return ["--device", "cpu", "--dtype", "float32", "--seq", "2048" if quick else "2048,4096", "--doc", "512",
            "--heads", "8", "--kv-heads", "2", "--dim", "64"]


def _ring_step_args(quick: bool) -> list[str]:
    """bench_ring_step's sizes: its defaults on a GPU, 2k-8k tokens on the CPU."""
    import torch

    if torch.cuda.is_available():
        return ["--seq", "32768"] if quick else []
    return ["--device", "cpu", "--dtype", "float32", "--seq", "2048" if quick else "2048,4096,8192", "--heads", "8",
            "--kv-heads", "2", "--dim", "64", "--repeats", "3"]


def _rank_args(quick: bool) -> list[str]:
    """bench_rank's sizes: Llama-3-8B shapes on a GPU, the tiny shape on the CPU."""
    import torch

    if torch.cuda.is_available():
        return ["--p", "4,8", "--seq", "32768", "--max-tokens", "8192"] if quick else \
            ["--max-tokens", "16384"]
    return ["--device", "cpu", "--dtype", "float32", "--shape", "small-llama3", "--p", "2,4", "--seq", "2048",
            "--matmul", "1024", "--compile", "aot_eager"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    args = parser.parse_args()
    seq = ["--seq", "2048"] if args.quick else []
    bench_lens = ["--seq-lens", "2048,4096"] if args.quick else []
    runs = [
        [sys.executable, os.path.join(HERE, "bench_attention.py"), *seq],
        [sys.executable, os.path.join(HERE, "bench_peers.py"), *seq],
        [sys.executable, os.path.join(HERE, "bench_balance.py"), *(["--rows", "50"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_varlen.py"), *(["--seq", "4096,8192"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_guard.py"), *(["--seq", "1024,2048"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_faults.py"),
         *(["--seq", "1024", "--repeats", "5"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_fuzz.py"), "--cases", "50" if args.quick else "200"],
        [sys.executable, os.path.join(HERE, "bench_soak.py"),
         *(["--steps", "400", "--warmup", "100"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_mixers.py"), *(["--seq", "1024"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_vision.py"), *(["--repeats", "2"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_kernels.py"), *_kernel_args(args.quick)],
        [sys.executable, os.path.join(HERE, "bench_ring_step.py"), *_ring_step_args(args.quick)],
        [sys.executable, os.path.join(HERE, "bench_rank.py"), *_rank_args(args.quick)],
        [sys.executable, "-m", "seqpar.cli.main", "bench", *bench_lens],
        [sys.executable, "-m", "seqpar.cli.main", "bench", "--packing", *bench_lens],
        [sys.executable, os.path.join(HERE, "bench_long_seq_goals.py"), "memory",
         *(["--seq-len", "8192"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_long_seq_goals.py"), "maxseq"],
        [sys.executable, os.path.join(HERE, "bench_objectives.py"), *(["--seq", "4096"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_ep.py"),
         *(["--seq", "1024", "--repeat", "2"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_nd.py"), *(["--seq", "2048", "--steps", "3"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_dit.py"),
         *(["--image", "1024", "--text", "64", "--repeats", "3"] if args.quick else [])],
        [sys.executable, os.path.join(HERE, "bench_alst.py"),
         *(["--seq-lens", "2048,4096", "--nproc", "2", "--limit", "8192"] if args.quick else [])],
    ]
    failed = 0
    for cmd in runs:
        print(f"\n$ {' '.join(os.path.relpath(c) if c.endswith('.py') else c for c in cmd[1:])}", flush=True)
        failed += subprocess.call(cmd) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
