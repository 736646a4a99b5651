"""The local attention kernels on one device, forward + backward of one block, in one run: the
varlen lse kernel ``auto`` picks (``cuda_flash`` on CUDA, ``flash_cpu`` on CPU), with ``--opt-in``
``cuda_cudnn`` and ``flex`` (CUDA), and ``tiled`` against SDPA with a dense mask (``sdpa_dense``,
the O(S^2) peer), on plain causal rows and on rows packed with fixed-length documents. Printed:
time and peak memory ratios (ours / dense) measured in the same process, and each kernel's max
error against the float64 oracle at the smallest length.

    python benchmarks/bench_kernels.py                        # CUDA if present: bf16, S = 8k..64k
    python benchmarks/bench_kernels.py --device cpu --seq 1024,2048 --dtype float32   # a dry run

Memory: ``torch.cuda.max_memory_allocated`` above the inputs on CUDA; on CPU the live-tensor
probe (:class:`seqpar.testing.memory.LiveMemory`). The dense peer is skipped where its mask alone
would pass ``--dense-limit`` GiB.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from seqpar.attention.kernels import KERNELS, attend, lse_kernel_for
from seqpar.attention.reference import math_attention
from seqpar.attention.spec import AttnSpec, MaskInfo

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _inputs(seq: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(seq)
    return [torch.randn(1, h, seq, dim, generator=g).to(device, dtype).requires_grad_(True)
            for h in (heads, kv_heads, kv_heads)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(kernel: str, q, k, v, spec: AttnSpec, mask: MaskInfo | None) -> None:
    out = attend(q, k, v, spec, mask, KERNELS[kernel])
    out.backward(torch.ones_like(out))
    q.grad = k.grad = v.grad = None


def _measure(kernel: str, q, k, v, spec, mask, repeats: int) -> tuple[float, float]:
    """(median seconds, peak MiB above the inputs) of forward + backward."""
    device = q.device
    _step(kernel, q, k, v, spec, mask)  # warm-up (and the per-batch plan)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _step(kernel, q, k, v, spec, mask)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        from seqpar.testing.memory import LiveMemory

        with LiveMemory() as probe:
            _step(kernel, q, k, v, spec, mask)
        peak = probe.peak_bytes / 2**20
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        _step(kernel, q, k, v, spec, mask)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), peak


def _error(kernel: str, q, k, v, spec, mask) -> float:
    """Max |error| of out and of dq, dk, dv against the float64 oracle (on the CPU)."""
    ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = attend(*ins, spec, mask, KERNELS[kernel])
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grads = torch.autograd.grad(out, ins, dout)
    ref_in = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    cpu_mask = None if mask is None else MaskInfo(q_seg=mask.q_seg.cpu(), k_seg=mask.k_seg.cpu())
    ref, _ = math_attention(*ref_in, spec, cpu_mask)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double().cpu())
    return max(float((a.detach().double().cpu() - b.detach()).abs().max())
               for a, b in zip((out, *grads), (ref, *ref_grads), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--seq", default="8192,16384,32768,65536", help="comma-separated lengths")
    parser.add_argument("--doc", type=int, default=2048, help="document length of the packed rows")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dense-limit", type=float, default=8.0, help="GiB the dense mask may take")
    parser.add_argument("--opt-in", action="store_true",
                        help="also the CUDA kernels not yet verified on a GPU (cuda_cudnn, flex: flex compiles first)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    spec = AttnSpec(causal=True)
    # on CUDA the fused kernel itself (auto uses it only once it is verified on a GPU)
    ours = "cuda_flash" if device.type == "cuda" else lse_kernel_for(device, dtype, spec)
    opt_in = ["cuda_cudnn", "flex"] if device.type == "cuda" and args.opt_in else []  # not yet verified on a GPU
    names = (ours, *opt_in, "tiled")
    lengths = [int(s) for s in args.seq.split(",")]
    print(f"{device} {args.dtype}, H={args.heads}/{args.kv_heads}, D={args.dim}, causal, fwd+bwd, "
          f"median of {args.repeats}; packed rows: {args.doc}-token documents")
    print(f"{'rows':<7} {'S':>6} {'kernel':<11} {'ms':>9} {'MiB':>9} {'time/dense':>10} {'mem/dense':>9}")
    for seq in lengths:
        q, k, v = _inputs(seq, args.heads, args.kv_heads, args.dim, dtype, device)
        seg = (torch.arange(seq, device=device) // args.doc)[None]
        for rows, mask in (("plain", None), ("packed", MaskInfo(q_seg=seg, k_seg=seg))):
            dense_ok = seq * seq / 2**30 <= args.dense_limit
            got = {}
            for name in (*names, *(["sdpa_dense"] if dense_ok else [])):
                got[name] = _measure(name, q, k, v, spec, mask, args.repeats)
            for name, (t, m) in got.items():
                ratio = (f"{t / got['sdpa_dense'][0]:10.2f} {m / max(got['sdpa_dense'][1], 1e-9):9.2f}"
                         if "sdpa_dense" in got and name != "sdpa_dense" else f"{'':>10} {'':>9}")
                print(f"{rows:<7} {seq:>6} {name:<11} {1e3 * t:9.1f} {m:9.1f} {ratio}")
    q, k, v = _inputs(min(lengths), args.heads, args.kv_heads, args.dim, dtype, device)
    seg = (torch.arange(min(lengths), device=device) // args.doc)[None]
    mask = MaskInfo(q_seg=seg, k_seg=seg)
    errors = {name: _error(name, q, k, v, spec, mask) for name in (*names, "sdpa_dense")}
    print(f"max |err| vs float64, packed S={min(lengths)}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))


if __name__ == "__main__":
    main()
