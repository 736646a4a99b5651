"""What the failure guard costs: Ulysses and ring forward + backward with the guard's fence as it
ships, and with the fence replaced by a no-op, on the same inputs, in one run, on local gloo
processes.

    python benchmarks/bench_guard.py            # P = 2, S = 1024 and 8192, 8 heads, causal, float32

The guard (seqpar.comm.guard) makes a failure in one rank's local compute raise on every rank
instead of hanging its peers. Ring and hybrid pay one one-number all-gather (and reading it on the
host) per attention call and direction; Ulysses' flag rides its last exchange, so its fence runs
only when a rank failed and the two variants should match. Each rank alternates the two variants
step by step; the figure is the median over repeats of the slowest rank, printed as a ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from seqpar.comm.launch import run_distributed


def _work(rank: int, world: int, seqs: list[int], heads: int, dim: int, repeats: int) -> dict:
    import seqpar.comm.guard as guard
    from seqpar.attention.ring import ring_attention
    from seqpar.attention.ulysses import ulysses_attention

    torch.set_num_threads(1)
    real = guard.fence
    out = {}
    for s in seqs:
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, s // world, heads, dim, generator=g, requires_grad=True) for _ in range(3))
        for strategy, fn in (("ulysses", ulysses_attention), ("ring", ring_attention)):
            times: dict[str, list[float]] = {"guarded": [], "unguarded": []}
            for _ in range(repeats):
                for name in times:
                    guard.fence = real if name == "guarded" else (lambda *a, **k: None)
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn(q, k, v, group=dist.group.WORLD, causal=True).sum().backward()
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    times[name].append(float(t))
            out[(s, strategy)] = {n: statistics.median(ts) for n, ts in times.items()}
    guard.fence = real
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq", type=str, default="1024,8192", help="comma-separated sequence lengths")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    seqs = [int(x) for x in args.seq.split(",")]
    res = run_distributed(_work, args.nproc, seqs, args.heads, args.dim, args.repeats)[0]
    print(f"{'P':>2} {'S':>6} {'strategy':<8} {'guarded ms':>11} {'unguarded ms':>13} {'ratio':>7}")
    for (s, strategy), t in res.items():
        print(f"{args.nproc:>2} {s:>6} {strategy:<8} {t['guarded'] * 1e3:11.2f} {t['unguarded'] * 1e3:13.2f} "
              f"{t['guarded'] / t['unguarded']:7.3f}")


if __name__ == "__main__":
    main()
