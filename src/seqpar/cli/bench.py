"""``seqpar bench``: per-rank peak memory and step time of a training step at several sequence
lengths, on P ranks against 1 rank, per strategy. Writes a CSV and a PNG plot, prints the ratios
(memory per rank at N tokens on P ranks / memory at N tokens on 1 rank).

Locally every configuration runs in fresh gloo worker processes (CPU, peak RSS above an idle
baseline). Under torchrun (GPUs: CUDA allocator peak) the job's world size is P, and the 1-rank
numbers come from every rank running the whole sequence alone.
"""

from __future__ import annotations

import argparse
import os
import sys


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 2048,4096, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="peak memory and step time per rank, P ranks vs 1 (CSV + PNG)",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="built-in model config name (sized as in seqpar train)")
    p.add_argument("--model-config", default="", metavar="JSON", help="JSON config fields over the training size")
    p.add_argument("--seq-lens", type=_ints, default=[4096, 8192, 16384], metavar="N,N,...",
                   help="sequence lengths (tokens per row)")
    p.add_argument("--nproc", type=_ints, default=[2, 4], metavar="P,P,...", help="rank counts to compare with 1")
    p.add_argument("--strategies", default="ulysses,ring,hybrid",
                   help="comma-separated: ulysses, ring, hybrid (hybrid only at P >= 4)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one untimed)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"], help="model dtype")
    p.add_argument("--out", default="bench_out", help="directory for bench.csv and bench.png")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a configuration counts as hung")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from seqpar import bench
    from seqpar.attention.dispatch import STRATEGIES

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"--strategies {args.strategies!r}: choose from {sorted(STRATEGIES)}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    cases = bench.cases(args.model, args.model_config, args.seq_lens, args.nproc, strategies, args.steps, args.dtype)
    bench.check_cases(cases)
    from seqpar.train.launcher import under_torchrun

    if under_torchrun():
        import torch

        if not torch.cuda.is_available():
            if int(os.environ.get("RANK", 0)) != 0:
                return 2  # rank 0 says why
            raise ValueError("seqpar bench under torchrun measures the CUDA allocator; on CPU run it without "
                             "torchrun (it starts fresh processes for every configuration)")
        world = int(os.environ["WORLD_SIZE"])
        cases = bench.cases(args.model, args.model_config, args.seq_lens, [world], strategies, args.steps, args.dtype)
        rows = bench.torchrun_rows(cases)
        if rows is None:
            return 0  # not rank 0
    else:
        rows = []
        for c in cases:
            print(f"  measuring P={c.nproc} {c.strategy if c.nproc > 1 else '':<8} seq_len={c.seq_len} ...",
                  file=sys.stderr, flush=True)
            rows.append(bench.run_case(c, timeout=args.timeout))
    bench.add_ratios(rows)
    os.makedirs(args.out, exist_ok=True)
    csv_path, png_path = os.path.join(args.out, "bench.csv"), os.path.join(args.out, "bench.png")
    bench.write_csv(rows, csv_path)
    bench.plot(rows, png_path, f"seqpar bench: {args.model} {args.dtype}, one training step per row")
    print(bench.format_table(rows))
    print(f"\nmemory = peak per rank above an idle baseline ({rows[0]['measure']}); ratio = P ranks / 1 rank "
          f"at the same length\nwrote {os.path.abspath(csv_path)} and {os.path.abspath(png_path)}")
    return 0
