"""``seqpar verify``: sequence-parallel attention (or a whole model) against the non-parallel
reference, forward and backward, on local gloo processes; non-zero exit past tolerance."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check SP results against the non-SP reference (float64)",
                       description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="number of local gloo processes (the SP degree)")
    p.add_argument("--model", default=None,
                   help="a built-in tiny config name (e.g. tiny-llama) or a local transformers checkpoint path;"
                        " without it, the attention grid is checked")
    p.add_argument("--strategy", default="ulysses", help="ulysses, ring or hybrid (where available)")
    p.add_argument("--tol", type=float, default=1e-10, help="max |error| allowed in float64 (attention grid)")
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung run fails")
    p.set_defaults(func=run)


def attention_grid(strategy: str, quick: bool) -> list:
    from seqpar.parity import AttnCase

    lengths = (7, 129) if quick else (1, 7, 37, 129)
    heads = ((8, 2), (6, 1)) if quick else ((8, 8), (8, 2), (8, 1), (6, 3), (6, 1), (12, 4))
    cases = [AttnCase(seq=s, heads=h, kv_heads=hk, causal=c, mask=m, strategy=strategy)
             for s in lengths for h, hk in heads for c in (False, True) for m in ("none", "pad", "packed")]
    cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, window=5, softcap=3.0, scale=0.3, mask="pad",
                       strategy=strategy)]
    if strategy == "ulysses":
        cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, kernel=k, mask=m, strategy=strategy)
                  for k in ("flash_cpu", "sdpa") for m in ("pad", "packed")]
    if strategy in ("ring", "hybrid"):  # the load-balanced layout, the fused CPU kernel, K/V gathered once
        cases += [AttnCase(seq=c.seq, heads=c.heads, kv_heads=c.kv_heads, causal=True, mask=c.mask, strategy=strategy,
                           options={"layout": "zigzag"}) for c in cases if c.causal and c.window is None]
        cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, kernel="flash_cpu", mask=m, window=w,
                           strategy=strategy, options={"layout": "zigzag", "comm": comm})
                  for m in ("pad", "packed") for w in (None, 5) for comm in ("p2p", "allgather")]
    return cases


def run(args: argparse.Namespace) -> int:
    if args.model:
        from seqpar.model_parity import verify_model_main

        return verify_model_main(args)
    from seqpar.launch import run_distributed
    from seqpar.parity import run_cases

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    cases = attention_grid(args.strategy, args.quick)
    rows = run_distributed(run_cases, args.nproc, cases, timeout=args.timeout)[0]
    header = f"{'P':>2} {'case':<58} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9}  ok"
    print(header)
    print("-" * len(header))
    failed = 0
    for row in rows:
        worst = max(row[n] for n in ("out", "dq", "dk", "dv"))
        ok = worst <= args.tol
        failed += not ok
        print(f"{row['P']:>2} {row['label']:<58} {row['out']:9.2e} {row['dq']:9.2e} {row['dk']:9.2e} "
              f"{row['dv']:9.2e}  {'ok' if ok else 'FAIL'}")
    worst_all = max(max(r[n] for n in ("out", "dq", "dk", "dv")) for r in rows)
    print(f"\n{len(rows) - failed} passed, {failed} failed (P={args.nproc}, float64, tol {args.tol:g},"
          f" worst |err| {worst_all:.2e})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace()))
