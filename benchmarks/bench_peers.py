"""seqpar's Ulysses against DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``) on
the same inputs, forward + backward, in one run, on local gloo processes.

    python benchmarks/bench_peers.py            # P = 2 and 4, S = 4096, 8 heads, causal, float32
    DS_BUILD_OPS=0 pip install deepspeed        # the peer (optional: without it only seqpar runs)

Both wrap the same local kernel (torch SDPA, causal) and take the same ``[B, S/P, H, D]`` shards, so
the difference is the communication: seqpar moves q, k, v in one exchange (one batch of
point-to-point transfers; 2 per call forward, 2 backward; the guard that raises a failure on every
rank is checked once per batch -- here one tiny all-gather when each step's backward ends), DeepSpeed
in three ``all_to_all_single`` (4 forward, 4 backward). Also timed:
that local kernel alone on the gathered ``[B, S, H/P, D]`` inputs, so each variant's *overhead*
(total minus kernel alone: communication and layout copies) can be compared. Each rank times every
variant in turn, step by step (the order rotating each repeat); a figure is the median over
repeats of the slowest rank; an overhead is the median of the per-repeat differences. The CPU
overhead is the same difference in process CPU time (every thread, gloo's included): the work
done, which a machine busy with other jobs disturbs less than the wall time. Also printed: the
collectives each variant issues per call, counted.

Also timed: the *bytes alone* -- the same messages between ready buffers, nothing else: the floor of
any implementation's communication on this transport (gloo over loopback TCP, whose copies are CPU
work), unless it overlaps the transfers with the kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.attention.heads import head_ranges
from seqpar.attention.shard import SeqShard
from seqpar.attention.ulysses import ulysses_attention
from seqpar.comm.counting import count_collectives
from seqpar.comm.launch import run_distributed

KERNEL = "kernel alone"
BYTES = "bytes alone"


def _raw_exchange(sends: list[torch.Tensor | None], recvs: list[torch.Tensor | None], group) -> None:
    """One batch of point-to-point transfers of ready, contiguous buffers: nothing copied."""
    ops = [dist.P2POp(op, t, dist.get_global_rank(group, peer), group=group)
           for peer, (s, r) in enumerate(zip(sends, recvs, strict=True)) if s is not None
           for op, t in ((dist.isend, s), (dist.irecv, r))]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


class _BytesAlone(torch.autograd.Function):
    """The bytes a Ulysses call must move, moved alone: the q/k/v and out exchanges forward, the
    dout and dq/dk/dv ones backward, each one message per peer of what goes to it, from buffers
    that need no copy -- the floor of any implementation's communication on this transport."""

    @staticmethod
    def forward(ctx, x, qkv, out, group):
        _raw_exchange(*qkv, group)
        _raw_exchange(*out, group)
        ctx.qkv, ctx.out, ctx.group = qkv, out, group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _raw_exchange(*ctx.out, ctx.group)
        _raw_exchange(*ctx.qkv, ctx.group)
        return grad, None, None, None


def _sdpa_bshd(q, k, v, *args, **kwargs):
    """The local attention both use: SDPA, causal, in the [B, S, H, D] layout DistributedAttention hands over."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _variants(rank: int, world: int, seq: int, heads: int, kv_heads: int, head_dim: int
              ) -> tuple[dict[str, Callable[[], torch.Tensor]], list[torch.Tensor]]:
    """Every timed call on this rank, and the tensors whose gradients a step clears."""
    group = dist.group.WORLD
    s_local = seq // world
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, s_local, h, head_dim, generator=g, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    # what the first all-to-all hands the kernel: the whole sequence, this rank's heads
    q_ranges, kv_ranges = head_ranges(heads, kv_heads, world)
    qg, kg, vg = (torch.randn(1, seq, n, head_dim, generator=g, requires_grad=True)  # [B, S, H/P, D]
                  for n in (q_ranges[rank][1], kv_ranges[rank][1], kv_ranges[rank][1]))
    shard = SeqShard((s_local,) * world)

    def buffers(to: list[int], back: list[int]) -> tuple[list, list]:  # numel to / from each peer
        return ([torch.randn(n) if p != rank else None for p, n in enumerate(to)],
                [torch.empty(n) if p != rank else None for p, n in enumerate(back)])

    heads_of = [qr[1] + 2 * kr[1] for qr, kr in zip(q_ranges, kv_ranges, strict=True)]  # q, k, v heads per rank
    # forward: my tokens x their heads go, their tokens x my heads come (every rank holds s_local tokens);
    # then the output: my heads over their tokens go, their heads over my tokens come
    qkv_bytes = buffers([s_local * n * head_dim for n in heads_of], [s_local * heads_of[rank] * head_dim] * world)
    out_bytes = buffers([s_local * q_ranges[rank][1] * head_dim] * world,
                        [s_local * qr[1] * head_dim for qr in q_ranges])
    x = torch.zeros(1, requires_grad=True)
    variants = {"seqpar ulysses": lambda: ulysses_attention(q, k, v, group=group, causal=True, kernel="sdpa",
                                                            shard=shard, validate=False),
                KERNEL: lambda: _sdpa_bshd(qg, kg, vg),
                BYTES: lambda: _BytesAlone.apply(x, qkv_bytes, out_bytes, group)}
    try:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group already running
        ds = DistributedAttention(_sdpa_bshd, group, scatter_idx=2, gather_idx=1)
        variants["deepspeed ulysses"] = lambda: ds(q, k, v, 0)
    except ImportError:
        pass
    return variants, [q, k, v, qg, kg, vg, x]


def _worker(rank: int, world: int, seq: int, heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict:
    torch.set_num_threads(1)  # P processes on a shared machine: OpenMP threads spinning against each other time noise
    variants, leaves = _variants(rank, world, seq, heads, kv_heads, head_dim)

    def step(fn):
        fn().sum().backward()
        for x in leaves:
            x.grad = None

    calls = {}
    for name, fn in variants.items():
        step(fn)  # warm up
        with count_collectives() as c:
            step(fn)
        calls[name] = sum(c.values())
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  # this process, all its threads (gloo's too)
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            step(variants[name])
            t = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(float(t[0]))
            cpu[name].append(float(t[1]))

    def overhead(ts: dict[str, list[float]]) -> dict[str, float]:
        return {n: statistics.median(t - k for t, k in zip(v, ts[KERNEL], strict=True)) for n, v in ts.items()
                if n not in (KERNEL, BYTES)}

    return {"median_s": {n: statistics.median(ts) for n, ts in times.items()}, "overhead_s": overhead(times),
            "cpu_overhead_s": overhead(cpu), "bytes_cpu_s": statistics.median(cpu[BYTES]), "collectives": calls}


def _report(p: int, res: dict) -> None:
    med, over, cpu = res["median_s"], res["overhead_s"], res["cpu_overhead_s"]
    print(f"{p:>2}  {KERNEL:<20} {med[KERNEL] * 1e3:9.1f}")
    print(f"{p:>2}  {BYTES:<20} {med[BYTES] * 1e3:9.1f} {'(the floor)':>12} {res['bytes_cpu_s'] * 1e3:12.1f}")
    for name in over:
        print(f"{p:>2}  {name:<20} {med[name] * 1e3:9.1f} {over[name] * 1e3:12.1f} {cpu[name] * 1e3:12.1f}"
              f" {res['collectives'][name]:>17}")
    if "deepspeed ulysses" not in over:
        print("    (deepspeed is not installed: DS_BUILD_OPS=0 pip install deepspeed)")
        return
    sp, ds = "seqpar ulysses", "deepspeed ulysses"
    overhead = f"{over[sp] / over[ds]:.2f}x" if over[ds] > 0 else "n/a (no deepspeed overhead measured)"
    print(f"{p:>2}  seqpar / deepspeed: total {med[sp] / med[ds]:.2f}x (goal <= 0.95x), "
          f"overhead {overhead} (goal <= 0.60x), cpu overhead {cpu[sp] / cpu[ds]:.2f}x")
    if over[ds] > 0:
        print(f"{p:>2}  moving the bytes alone takes {med[BYTES] / over[ds]:.2f}x deepspeed's overhead; above that "
              f"floor: seqpar {(over[sp] - med[BYTES]) * 1e3:.1f} ms, deepspeed {(over[ds] - med[BYTES]) * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    print(f"S={args.seq} heads={args.heads}/{args.kv_heads} D={args.head_dim} causal float32, forward+backward, "
          f"median of {args.repeats}, slowest rank; overhead = total - {KERNEL} on [B, S, H/P, D]")
    print(f"{'P':>2}  {'variant':<20} {'total ms':>9} {'overhead ms':>12} {'cpu over ms':>12} {'collectives/call':>17}")
    for p in args.nproc:
        _report(p, run_distributed(_worker, p, args.seq, args.heads, args.kv_heads, args.head_dim, args.repeats,
                                   timeout=900)[0])


if __name__ == "__main__":
    main()
