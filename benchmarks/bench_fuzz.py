"""Seeded fuzz of sp_attention and shard_batch + parallelize (issue 26, item 7): N cases per world
size, every one exact against the unsharded float64 reference or a ValueError on every rank
(:mod:`seqpar.testing.fuzz`); prints the counts by outcome and every failing case with its seed.

    python benchmarks/bench_fuzz.py --cases 500            # 500 cases at each of P = 2, 3, 4
    python benchmarks/bench_fuzz.py --seed 1234 --cases 1 --nproc 3     # replay one case

Seeds run from --seed upward; a case's seed alone draws it (the same at any --cases).
"""

from __future__ import annotations

import argparse
import sys
import time

PG_TIMEOUT_S = 10.0  # a case that leaves a rank waiting fails this fast, as a "timeout"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=200, help="cases per world size")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--nproc", default="2,3,4", help="world sizes, comma-separated")
    args = parser.parse_args(argv)
    from seqpar.testing.fuzz import problems, run_fuzz

    failed = 0
    for world in (int(p) for p in args.nproc.split(",")):
        seeds = list(range(args.seed, args.seed + args.cases))
        t0 = time.perf_counter()
        per_rank = run_fuzz(world, seeds, pg_timeout=PG_TIMEOUT_S)
        counts, bad = problems(world, seeds, per_rank)
        print(f"fuzz P={world}: {len(seeds)} cases (seeds {seeds[0]}..{seeds[-1]}) in {time.perf_counter() - t0:.0f} s")
        for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {n:>5}  {key}")
        for line in bad:
            print(f"  FAILED {line}")
        failed += len(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
