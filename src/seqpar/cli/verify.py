"""``seqpar verify``: sequence-parallel attention (or a whole model) against the non-parallel
reference, forward and backward, on local gloo processes; non-zero exit past tolerance."""

from __future__ import annotations

import argparse


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


def run(args: argparse.Namespace) -> int:
    if args.model:
        return verify_model(args)
    from seqpar.comm.launch import run_distributed
    from seqpar.testing.attention_parity import attention_grid, run_cases

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


def verify_model(args: argparse.Namespace) -> int:
    """``seqpar verify --model NAME --nproc P``: print per case the loss difference and the largest
    gradient difference per parameter group; 1 if any is past tolerance (loss 1e-9, grads 1e-8)."""
    from seqpar.comm.launch import run_distributed
    from seqpar.integrations.models import check_model_name
    from seqpar.testing.model_parity import F32_GRAD_RTOL, GRAD_TOL, LOSS_TOL, model_cases, row_ok, run_model_parity

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    check_model_name(args.model)
    cases = model_cases(args.model, args.strategy)
    rows = run_distributed(run_model_parity, args.nproc, cases, timeout=args.timeout)[0]
    groups = sorted({g for r in rows for g in r["grad_diff"]})
    f32 = any(r["f32_params"] for r in rows)
    header = (f"{'P':>2} {'case':<58} {'loss':>9} " + " ".join(f"{g:>9}" for g in groups)
              + (f" {'f32 rel':>9}" if f32 else "") + "  ok")
    print("max |SP - non-SP| in float64: loss, then gradients per parameter group")
    print(header)
    print("-" * len(header))
    failed = 0
    for r in rows:
        ok = row_ok(r)
        failed += not ok
        cells = " ".join(f"{r['grad_diff'].get(g, 0.0):9.2e}" for g in groups)
        extra = f" {r['f32_rel']:9.2e}" if f32 else ""
        print(f"{r['P']:>2} {r['label']:<58} {r['loss_diff']:9.2e} {cells}{extra}  {'ok' if ok else 'FAIL'}")
    if f32:
        print(f"(f32 rel: weights the model computes in float32 itself, relative error, tolerance {F32_GRAD_RTOL:g})")
    worst_loss = max(r["loss_diff"] for r in rows)
    worst = max(rows, key=lambda r: r["grad_max"])
    print(f"\n{len(rows) - failed} passed, {failed} failed ({args.model}, P={args.nproc}, float64; tolerances loss "
          f"{LOSS_TOL:g}, grads {GRAD_TOL:g}); worst loss diff {worst_loss:.2e}, worst grad diff "
          f"{worst['grad_max']:.2e} ({worst['worst_param']})")
    return 1 if failed else 0
