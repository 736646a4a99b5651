"""Time sequence-parallel attention strategies, forward + backward, on the same inputs in one run.

    python benchmarks/bench_attention.py                  # P = 2 and 4, S = 4096, causal, float32
    python benchmarks/bench_attention.py --nproc 4 --seq 8192 --repeats 5

Every strategy gets the same global q, k, v (seeded), the fused CPU kernel (``flash_cpu``), a
SeqShard built once (as ``shard_batch`` does) and ``validate=False`` (as the HF integration calls
it), so the figures are the steady-state cost of one attention layer. A step's time is the slowest
rank's (barrier before each step); the strategies take turns step by step, so a busy moment on the
machine hits all of them; the table gives the median over the repeats and the ratio to Ulysses.
The ranks are local gloo processes: with fewer cores than processes they share cores, and the
figures include that contention.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from seqpar.attention.blocks import RingStats
from seqpar.attention.hybrid import hybrid_attention, hybrid_groups
from seqpar.attention.layout import layout_indices, layout_permutation, layout_seq_lens
from seqpar.attention.ring import ring_attention
from seqpar.attention.shard import SeqShard
from seqpar.attention.ulysses import ulysses_attention
from seqpar.comm.launch import run_distributed

# name, layout (hybrid: ulysses = 2 where P is even, ring = P / 2)
STRATEGIES = (
    ("ulysses", "contiguous"),
    ("ring p2p zigzag", "zigzag"),
    ("ring p2p contiguous", "contiguous"),
    ("ring allgather zigzag", "zigzag"),
    ("hybrid zigzag", "zigzag"),
)


def _hybrid_degree(world: int) -> int:
    return 2 if world % 2 == 0 else 1


def _call(name: str, q, k, v, shard: SeqShard, groups, stats: RingStats):
    world = dist.group.WORLD
    common = dict(causal=True, kernel="flash_cpu", shard=shard, validate=False)
    if name == "ulysses":
        return ulysses_attention(q, k, v, group=world, **common)
    if name.startswith("ring"):
        comm = "allgather" if "allgather" in name else "p2p"
        return ring_attention(q, k, v, group=world, comm=comm, stats=stats, **common)
    return hybrid_attention(q, k, v, ulysses_group=groups[0], ring_group=groups[1], stats=stats, **common)


def _bench(rank: int, world: int, args: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(0)
    s, b, h, hk, d = args.seq, 1, args.heads, args.kv_heads, args.head_dim
    full = [torch.randn(b, s, n, d, generator=g) for n in (h, hk, hk)]
    dout = torch.randn(b, s, h, d, generator=g)
    u = _hybrid_degree(world)
    groups = hybrid_groups(dist.group.WORLD, u)
    runs = {}
    for name, layout in STRATEGIES:
        ulysses = u if name.startswith("hybrid") else 1
        idx = layout_indices(s, world, layout, ulysses)[rank]
        shard = SeqShard(layout_seq_lens(s, world, layout, ulysses),
                         None if layout == "contiguous" else layout_permutation(s, world, layout, ulysses))
        runs[name] = (idx, shard, [t[:, idx].clone().requires_grad_(True) for t in full])
    times: dict[str, list[float]] = {name: [] for name, _ in STRATEGIES}
    stats = {name: RingStats() for name, _ in STRATEGIES}
    # strategies interleaved step by step, so that a busy moment on the machine hits all of them
    for i in range(args.warmup + args.repeats):
        for name, _ in STRATEGIES:
            idx, shard, (q, k, v) = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            _call(name, q, k, v, shard, groups, stats[name] if i == 0 else RingStats()).backward(dout[:, idx])
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            if i >= args.warmup:
                times[name].append(float(t))
    return {name: {"median": statistics.median(times[name]), "visible": stats[name].visible_pairs,
                   "label": f"hybrid {world // u}x{u} zigzag" if name.startswith("hybrid") else name}
            for name, _ in STRATEGIES}


def _table(world: int, res: list[dict], args: argparse.Namespace) -> str:
    base = res[0]["ulysses"]["median"]
    lines = [f"P={world}  S={args.seq}  H={args.heads}/{args.kv_heads}  D={args.head_dim}  causal  float32  flash_cpu"
             f"  (median of {args.repeats}, slowest rank)",
             f"{'strategy':<24} {'fwd+bwd ms':>11} {'vs ulysses':>11} {'ring work max/mean':>19}"]
    for name, _ in STRATEGIES:
        r = res[0][name]
        work = [per_rank[name]["visible"] for per_rank in res]
        balance = f"{max(work) / (sum(work) / world):.2f}" if sum(work) else "-"
        lines.append(f"{r['label']:<24} {1000 * r['median']:>11.1f} {r['median'] / base:>10.2f}x {balance:>19}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="world sizes to run")
    parser.add_argument("--seq", type=int, default=4096, help="global sequence length")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per strategy")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per strategy first")
    args = parser.parse_args(argv)
    for world in args.nproc:
        res = run_distributed(_bench, world, args, timeout=1800)
        print(_table(world, res, args), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
