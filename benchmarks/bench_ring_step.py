"""A ring rank's attention against the fused op alone on the same blocks (issue 27), in one run.

Rank ``r`` of a ``P``-rank causal zigzag ring, run in this one process on torch's fake process group
(:func:`seqpar.compat.fake_process_group`: the K/V hops move no bytes, so what is timed is the
rank's kernels, merges and bookkeeping -- the ring step's compute). Forward + backward of:

* ``sdpa``     the fused op alone: ``F.scaled_dot_product_attention`` (enable_gqa, its causal
               flag) on each of the rank's blocks as the plans trim them, summed -- the floor;
* ``fused``    the real ring call: full and plain-causal blocks run the kernel's fused op once;
* ``rects``    the same call on a batch whose padding mask is all True: every block goes through
               the kernel's document rectangles (the path every block took before the fast path).

Printed: milliseconds (the fastest of ``--repeats``, the three run in turn) and the ratios
``fused / sdpa`` (the issue's goal: <= 1.1 on a GPU, bf16, D = 128) and ``rects / sdpa``. Sizes
are the whole sequence ``S`` (each rank holds ``S / P``). On a shared CPU run it with
``OMP_NUM_THREADS=1``: the figures of a loaded machine's threads are noise.

    python benchmarks/bench_ring_step.py                                   # CUDA: bf16, S = 32k..128k
    OMP_NUM_THREADS=1 python benchmarks/bench_ring_step.py --device cpu --dtype float32 --seq 2048,4096,8192 \
        --heads 8 --kv-heads 2 --dim 64
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar import compat
from seqpar.attention.blocks import RingStats
from seqpar.attention.cuda import CudaFlashKernel
from seqpar.attention.layout import layout_permutation
from seqpar.attention.ring import ring_attention
from seqpar.attention.ring_loop import block_plans
from seqpar.attention.shard import SeqShard
from seqpar.attention.spec import AttnSpec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _timed(fns: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """Each ``fns[name]()``'s fastest time in milliseconds after one warm-up, the functions run in
    turn within each repeat (a shared, loaded machine then slows them alike; the minimum drops what
    other processes added)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * min(ts) for name, ts in times.items()}


def measure(seq: int, p: int, rank: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
            device: torch.device, repeats: int, kernel: str | CudaFlashKernel = "auto") -> dict[str, float]:
    """``{"sdpa", "fused", "rects"}`` milliseconds of rank ``rank``'s forward + backward (see the
    module doc), and the blocks the fused call ran (``"ops"``)."""
    n = seq // p
    perm = layout_permutation(seq, p, "zigzag")
    g = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(1, n, h, dim, generator=g).to(device, dtype).requires_grad_(True)
               for h in (heads, kv_heads, kv_heads))  # [B, S/P, H, D]
    spec = AttnSpec(causal=True)
    plain = SeqShard((n,) * p, perm.to(device))
    blocks = [(p_.rows[1], p_.cols[1], p_.fused == "causal") for p_ in block_plans(plain, spec, rank)
              if p_ is not None]

    def sdpa() -> None:
        for nr, nc, causal in blocks:
            qb = q[:, :nr].transpose(1, 2)  # [B, H, nr, D]: the block's shape (values do not matter)
            kb, vb = (x[:, :nc].transpose(1, 2) for x in (k, v))
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, enable_gqa=heads != kv_heads)
            out.backward(torch.ones_like(out))

    def ring(shard: SeqShard, stats: RingStats | None = None):
        def step() -> None:
            out = ring_attention(q, k, v, group=dist.group.WORLD, causal=True, shard=shard, validate=False,
                                 kernel=kernel, stats=stats)
            out.backward(torch.ones_like(out))
        return step

    stats = RingStats()
    padded = SeqShard((n,) * p, perm.to(device), torch.ones(1, seq, dtype=torch.bool, device=device))
    with compat.fake_process_group(rank, p):
        ring(plain, stats)()
        times = _timed({"sdpa": sdpa, "fused": ring(plain), "rects": ring(padded)}, device, repeats)
    return {**times, "ops": dict(stats.ops)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--seq", default="32768,65536,131072", help="comma-separated whole-sequence lengths")
    parser.add_argument("--p", type=int, default=4, help="ring size")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--native-gqa", action="store_true",
                        help="CUDA: cuda_flash handing FlashAttention-2 the KV heads as they are")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    kernel = CudaFlashKernel(native_gqa=True) if args.native_gqa else "auto"
    print(f"ring rank {args.rank} of {args.p}, zigzag causal, {args.heads}/{args.kv_heads} heads, D={args.dim}, "
          f"{args.dtype} on {device}" + (" (native GQA)" if args.native_gqa else ""))
    print(f"{'S':>8} {'sdpa ms':>9} {'fused ms':>9} {'rects ms':>9} {'fused/sdpa':>11} {'rects/sdpa':>11}  blocks")
    for seq in (int(s) for s in args.seq.split(",")):
        m = measure(seq, args.p, args.rank, args.heads, args.kv_heads, args.dim, dtype, device, args.repeats, kernel)
        print(f"{seq:>8} {m['sdpa']:>9.2f} {m['fused']:>9.2f} {m['rects']:>9.2f} {m['fused'] / m['sdpa']:>11.2f} "
              f"{m['rects'] / m['sdpa']:>11.2f}  {m['ops']}")


if __name__ == "__main__":
    main()
