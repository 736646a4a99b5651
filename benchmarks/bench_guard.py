"""What the failure guard costs: a stack of attention layers (Ulysses, ring), forward + backward, with
the guard checked once per batch (as it ships for a batch's SeqShard under autograd), checked per
call, and with its fence replaced by a no-op, on the same inputs, in one run, on local gloo processes.

    python benchmarks/bench_guard.py            # P = 2, S = 1024 and 8192, 8 heads, 4 layers, causal, float32

The guard (seqpar.comm.guard) makes a failure in one rank's local compute raise on every rank
instead of hanging its peers. Checked per call, ring and hybrid pay one one-number all-gather and
a host read per call and direction (Ulysses' flag rides its last exchange, the read remains);
checked once per batch, a step pays one all-gather when its backward ends, however many layers it
has. Each rank alternates the variants step by step; the figure is the median over repeats of the
slowest rank, printed as a ratio to the no-op fence.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from seqpar.comm.launch import run_distributed

VARIANTS = ("per batch", "per call", "no-op fence")


def _step(fn, q, k, v, shard, layers: int) -> None:
    """``layers`` calls of one batch (each call's output is the next one's queries), then the backward."""
    x = q
    for _ in range(layers):
        x = fn(x, k, v, group=dist.group.WORLD, causal=True, shard=shard, validate=False)
    x.sum().backward()


def _work(rank: int, world: int, seqs: list[int], heads: int, dim: int, layers: int, repeats: int) -> dict:
    import seqpar.attention.call as call_module
    import seqpar.comm.guard as guard
    from seqpar.attention.ring import ring_attention
    from seqpar.attention.shard import SeqShard
    from seqpar.attention.ulysses import ulysses_attention

    torch.set_num_threads(1)
    real_fence, real_check = guard.fence, call_module.deferred_check

    def use(variant: str) -> None:
        per_call = variant != "per batch"
        call_module.deferred_check = (lambda *a: None) if per_call else real_check  # every strategy prepares there
        guard.fence = (lambda *a, **k: None) if variant == "no-op fence" else real_fence

    out = {}
    for s in seqs:
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, s // world, heads, dim, generator=g, requires_grad=True) for _ in range(3))
        shard = SeqShard((s // world,) * world)
        for strategy, fn in (("ulysses", ulysses_attention), ("ring", ring_attention)):
            times: dict[str, list[float]] = {n: [] for n in VARIANTS}
            for _ in range(repeats):
                for name in VARIANTS:
                    use(name)
                    dist.barrier()
                    t0 = time.perf_counter()
                    _step(fn, q, k, v, shard, layers)
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    times[name].append(float(t))
            out[(s, strategy)] = {n: statistics.median(ts) for n, ts in times.items()}
    use("per batch")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq", type=str, default="1024,8192", help="comma-separated sequence lengths")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    seqs = [int(x) for x in args.seq.split(",")]
    res = run_distributed(_work, args.nproc, seqs, args.heads, args.dim, args.layers, args.repeats, timeout=1800)[0]
    print(f"{args.layers} layers, forward + backward; ms per step, ratio to the no-op fence")
    print(f"{'P':>2} {'S':>6} {'strategy':<8} " + " ".join(f"{n:>12}" for n in VARIANTS) + "  per batch  per call")
    for (s, strategy), t in res.items():
        base = t["no-op fence"]
        print(f"{args.nproc:>2} {s:>6} {strategy:<8} " + " ".join(f"{t[n] * 1e3:12.2f}" for n in VARIANTS)
              + f"  {t['per batch'] / base:9.3f} {t['per call'] / base:9.3f}")


if __name__ == "__main__":
    main()
