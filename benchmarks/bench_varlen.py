"""Packed rows in O(S) memory: ring attention (flash_cpu) forward + backward on plain rows and on rows
packed with fixed-length documents, per-rank peak memory above the inputs and time, in one run.

    python benchmarks/bench_varlen.py           # P = 2, S = 8192 and 16384, 512-token documents

Each configuration runs in fresh gloo worker processes; memory is the peak RSS (VmHWM, reset after
the inputs are built) minus the RSS then, the slowest rank's. Printed: packed / plain at each
length, and each layout's growth from one length to the next (linear memory gives 2.0 for 2x S).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from seqpar.bench.probes import peak_rss_mib, reset_peak_rss, rss_mib
from seqpar.comm.launch import run_distributed


def _work(rank: int, world: int, seq: int, doc: int | None, heads: int, dim: int) -> dict[str, float]:
    from seqpar.attention.ring import ring_attention
    from seqpar.attention.shard import SeqShard

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    n = seq // world
    q, k, v = (torch.randn(1, n, heads, dim, generator=g, requires_grad=True) for _ in range(3))
    segments = None if doc is None else (torch.arange(seq) // doc)[None]  # [1, S] document ids
    shard = SeqShard((n,) * world, None, None, segments)
    ring_attention(q, k, v, group=dist.group.WORLD, causal=True, shard=shard, validate=False).sum().backward()
    reset_ok, base = reset_peak_rss(), rss_mib()
    t0 = time.perf_counter()
    ring_attention(q, k, v, group=dist.group.WORLD, causal=True, shard=shard, validate=False).sum().backward()
    out = torch.tensor([time.perf_counter() - t0, peak_rss_mib(reset_ok) - base])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return {"s": float(out[0]), "mib": float(out[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq", type=str, default="8192,16384", help="comma-separated sequence lengths")
    parser.add_argument("--doc", type=int, default=512, help="document length of the packed rows")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    seqs = [int(x) for x in args.seq.split(",")]
    res = {(s, d): run_distributed(_work, args.nproc, s, d, args.heads, args.dim)[0]
           for s in seqs for d in (None, args.doc)}
    print(f"ring attention, P={args.nproc}, causal, {args.heads} heads x {args.dim}, float32, fwd+bwd; "
          f"packed = {args.doc}-token documents")
    print(f"{'S':>7} {'plain MiB':>10} {'packed MiB':>11} {'packed/plain':>13} {'plain s':>8} {'packed s':>9}")
    for s in seqs:
        a, b = res[(s, None)], res[(s, args.doc)]
        print(f"{s:>7} {a['mib']:10.1f} {b['mib']:11.1f} {b['mib'] / max(a['mib'], 1e-9):13.2f} {a['s']:8.2f} "
              f"{b['s']:9.2f}")
    for s0, s1 in zip(seqs, seqs[1:], strict=False):
        print(f"growth {s0} -> {s1}: plain {res[(s1, None)]['mib'] / res[(s0, None)]['mib']:.2f}x, "
              f"packed {res[(s1, args.doc)]['mib'] / res[(s0, args.doc)]['mib']:.2f}x")


if __name__ == "__main__":
    main()
