"""The local attention kernels on one device, forward + backward of one block, in one run:
``cuda_flash`` (CUDA; verified on a GPU) or ``flash_cpu`` (CPU), with ``--opt-in`` the other CUDA
kernels ``cuda_cudnn`` and ``flex`` (which ``auto`` measures against ``cuda_flash`` once they are
verified: ``--choice``), and ``tiled`` against SDPA with a dense mask (``sdpa_dense``,
the O(S^2) peer), on plain causal rows and on rows packed with fixed-length documents. Printed:
time and peak memory ratios (ours / dense) measured in the same process, and each kernel's max
error against the float64 oracle at the smallest length.

    python benchmarks/bench_kernels.py                        # CUDA if present: bf16, S = 8k..64k
    python benchmarks/bench_kernels.py --device cpu --seq 1024,2048 --dtype float32   # a dry run
    python benchmarks/bench_kernels.py --choice --seq 8192,32768 --heads 32 --kv-heads 8   # auto's choice

``--choice``: what ``kernel="auto"`` chooses on this device (issue 27): per length, for a ring's
fused causal block, a fused full block and a masked block (packed documents), forward and backward
apart, each candidate's time as ``auto`` measures it (:mod:`seqpar.attention.kernel_choice`: CUDA
events, the faster of two runs after a warm-up), the fastest, and the one ``auto`` runs -- the
fastest of those verified on this GPU (``*`` marks a candidate that is not). ``--candidates``
(default: the verified ones; on CPU flash_cpu and tiled, a dry run) names the kernels to time.

Memory: ``torch.cuda.max_memory_allocated`` above the inputs on CUDA; on CPU the live-tensor
probe (:class:`seqpar.testing.memory.LiveMemory`). The dense peer is skipped where its mask alone
would pass ``--dense-limit`` GiB.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from seqpar.attention.kernel_choice import FastestKernel, ShapeClass, eligible, measuring
from seqpar.attention.kernels import (
    KERNELS,
    attend,
    cuda_candidates,
    describe_kernels,
    lse_kernel_for,
    verified_kernels,
)
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


def choice_rows(device: torch.device, dtype: torch.dtype, lengths: list[int], heads: int, kv_heads: int, dim: int,
                doc: int, names: list[str]) -> list[tuple[int, ShapeClass, dict[str, float | None], str]]:
    """``(S, shape class, seconds per candidate (None: it failed), the fastest)`` for a fused causal,
    a fused full and a masked (``doc``-token documents) causal block of ``S x S``, forward and
    backward, timed by :class:`FastestKernel` over ``names`` as ``auto`` times them."""
    fastest = FastestKernel(KERNELS.__getitem__, lambda dev, dt, spec: eligible(names, names, KERNELS, spec))
    spec, rows = AttnSpec(causal=True), []
    for seq in lengths:
        q, k, v = (t.detach() for t in _inputs(seq, heads, kv_heads, dim, dtype, device))
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
        seg = (torch.arange(seq, device=device) // doc)[None]
        mask = MaskInfo(q_seg=seg, k_seg=seg)
        for causal in (True, False):
            out, lse = fastest.fused_forward(q, k, v, spec, causal)
            fastest.fused_backward(dout, q, k, v, out, lse, spec, causal)
        out, lse = fastest.forward(q, k, v, spec, mask)
        fastest.backward(dout, q, k, v, out, lse, spec, mask)
        rows += [(seq, key, dict(c.seconds), c.kernel) for key, c in fastest.chosen.items() if key.sq == seq]
        del q, k, v, dout, out, lse
    return rows


def print_choice(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, lengths: list[int]) -> None:
    """The ``--choice`` table (see the module doc)."""
    if not measuring():
        raise SystemExit("SEQPAR_MEASURE_KERNELS=0: auto does not measure (unset it to see its choice)")
    cuda = device.type == "cuda"
    verified = verified_kernels(device) if cuda else {"flash_cpu", "tiled"}
    names = (args.candidates.split(",") if args.candidates
             else cuda_candidates(device, dtype, AttnSpec(causal=True)) if cuda else ["flash_cpu", "tiled"])
    if cuda:
        print(describe_kernels(device))
    print(f"auto's choice on {device} {args.dtype}, B=1, H={args.heads}/{args.kv_heads}, D={args.dim}, causal; "
          f"masked = {args.doc}-token documents; ms per call (* not verified on this GPU: auto skips it)")
    head = "".join(f"{n + ('' if n in verified else '*'):>12}" for n in names)
    print(f"{'S':>6}  {'block':<12} {'dir':<8}{head}  {'fastest':<11} auto runs")
    for seq, key, seconds, best in choice_rows(device, dtype, lengths, args.heads, args.kv_heads, args.dim, args.doc,
                                               names):
        times = "".join(f"{'failed' if seconds.get(n) is None else f'{1e3 * seconds[n]:.2f}':>12}" for n in names)
        ok = {n: t for n, t in seconds.items() if t is not None and n in verified}
        runs = min(ok, key=ok.__getitem__) if ok else "-"
        print(f"{seq:>6}  {key.block:<12} {key.direction:<8}{times}  {best:<11} {runs}")


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
    parser.add_argument("--choice", action="store_true", help="auto's measured choice per block and length instead")
    parser.add_argument("--candidates", default="", help="with --choice: the kernels to time (default: the verified)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.choice:
        print_choice(args, device, dtype, [int(s) for s in args.seq.split(",")])
        return
    spec = AttnSpec(causal=True)
    # on CUDA each fused kernel by name (auto's measured pick among the verified ones: --choice)
    ours = "cuda_flash" if device.type == "cuda" else lse_kernel_for(device, dtype, spec)
    opt_in = ["cuda_cudnn", "flex"] if device.type == "cuda" and args.opt_in else []
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
