"""seqpar's Ulysses against DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``) on
the same inputs, forward + backward, in one run, on local gloo processes.

    python benchmarks/bench_peers.py            # P = 2 and 4, S = 4096, 8 heads, causal, float32
    DS_BUILD_OPS=0 pip install deepspeed        # the peer (optional: without it only seqpar runs)

Both wrap the same local kernel (torch SDPA) and take the same ``[B, S/P, H, D]`` shards, so the
difference is the communication: seqpar moves q, k, v in one all-to-all (2 per call forward, 2
backward, plus one one-number all-gather each way: the guard that raises a failure on every rank),
DeepSpeed in three (4 forward, 4 backward). Each rank times every variant in turn, step
by step; the figure is the median over repeats of the slowest rank. Also printed: the collectives
each variant issues per call, counted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.attention.shard import SeqShard
from seqpar.attention.ulysses import ulysses_attention
from seqpar.comm.counting import count_collectives
from seqpar.comm.launch import run_distributed


def _sdpa_bshd(q, k, v, *args, **kwargs):
    """The peer's local attention: SDPA in the [B, S, H, D] layout DistributedAttention hands over."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _worker(rank: int, world: int, seq: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
    group = dist.group.WORLD
    s_local = seq // world
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, s_local, h, head_dim, generator=g, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    shard = SeqShard((s_local,) * world)
    variants = {"seqpar ulysses": lambda: ulysses_attention(q, k, v, group=group, causal=True, kernel="sdpa",
                                                            shard=shard, validate=False)}
    try:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group already running
        ds = DistributedAttention(_sdpa_bshd, group, scatter_idx=2, gather_idx=1)
        variants["deepspeed ulysses"] = lambda: ds(q, k, v, 0)
    except ImportError:
        pass

    def step(fn):
        out = fn()
        out.sum().backward()
        q.grad = k.grad = v.grad = None

    calls = {}
    for name, fn in variants.items():
        step(fn)  # warm up
        with count_collectives() as c:
            step(fn)
        calls[name] = sum(c.values())
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(fn)
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(float(t))
    return {"median_s": {n: statistics.median(ts) for n, ts in times.items()}, "collectives": calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    print(f"S={args.seq} heads={args.heads}/{args.kv_heads} D={args.head_dim} causal float32, forward+backward, "
          f"median of {args.repeats}, slowest rank")
    print(f"{'P':>2}  {'variant':<20} {'ms':>9} {'vs seqpar':>10} {'collectives/call':>17}")
    for p in args.nproc:
        res = run_distributed(_worker, p, args.seq, args.heads, args.kv_heads, args.head_dim, args.repeats,
                              timeout=900)[0]
        base = res["median_s"]["seqpar ulysses"]
        for name, t in res["median_s"].items():
            print(f"{p:>2}  {name:<20} {t * 1e3:9.1f} {t / base:9.2f}x {res['collectives'][name]:>17}")
        if len(res["median_s"]) == 1:
            print("    (deepspeed is not installed: DS_BUILD_OPS=0 pip install deepspeed)")


if __name__ == "__main__":
    main()
