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
    p.add_argument("--zoo", action="store_true",
                   help="every causal-LM class of the installed transformers, tiny and float64: exact or refused")
    p.add_argument("--vlm-zoo", action="store_true",
                   help="every image-text-to-text class of the installed transformers, tiny and float64, with images:"
                        " exact, refused (the mechanism named) or not runnable here (why); --quick: Ulysses only")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung run fails")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    import torch

    if torch.cuda.is_available():  # said, not silent: the float64 checks run on local CPU processes
        print(cuda_note(torch.cuda.device_count()), file=sys.stderr, flush=True)
    if args.zoo:
        return verify_zoo(args)
    if args.vlm_zoo or (args.model and is_vlm_checkpoint(args.model)):
        from seqpar.cli.verify_vlm import verify_vlm_model, verify_vlm_zoo

        return verify_vlm_zoo(args) if args.vlm_zoo else verify_vlm_model(args)
    if args.model:
        return verify_model(args)
    from seqpar.comm.launch import run_distributed
    from seqpar.testing.attention_parity import ERRORS, attention_grid, bad_rows, run_cases

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    cases = attention_grid(args.strategy, args.quick)
    rows = run_distributed(run_cases, args.nproc, cases, timeout=args.timeout)[0]
    header = f"{'P':>2} {'case':<58} " + " ".join(f"{n:>9}" for n in ERRORS) + "  ok"
    print(header)
    print("-" * len(header))
    bad = {label for label, _ in bad_rows(rows, args.tol)}
    for row in rows:
        cells = " ".join(f"{row[n]:9.2e}" for n in ERRORS)
        ok = "ok" if row["label"] not in bad else ("FAIL" if row["contiguous"] == 1.0 else "FAIL (non-contiguous)")
        print(f"{row['P']:>2} {row['label']:<58} {cells}  {ok}")
    worst_all = max(max(r[n] for n in ERRORS) for r in rows)
    print(f"\n{len(rows) - len(bad)} passed, {len(bad)} failed (P={args.nproc}, float64, tol {args.tol:g},"
          f" worst |err| {worst_all:.2e})")
    return 1 if bad else 0


def is_vlm_checkpoint(model: str) -> bool:
    """Whether ``--model`` names a local vision-language checkpoint (then it is checked with images)."""
    import os

    from seqpar.testing.vlm_zoo import is_vlm_checkpoint as vlm

    return os.path.isdir(model) and vlm(model)


def cuda_note(devices: int) -> str:
    """What ``seqpar verify`` says on a CUDA host: its checks run on CPU processes, and which CUDA
    kernels have not passed ``make gpu-check`` yet (opt-in until then)."""
    import torch

    from seqpar.attention import kernels

    # the committed set and this GPU's own record (what auto runs here)
    unverified = [name for name, ok in kernels.gpu_verified(torch.device("cuda")).items() if not ok]
    return (f"seqpar verify: this host has {devices} CUDA device(s), but these checks run on local CPU processes "
            "(gloo, float64); the CUDA kernels are checked by `make gpu-check`"
            + (f" -- not yet passed there, so opt-in: {', '.join(unverified)}" if unverified else ""))


def verify_model(args: argparse.Namespace) -> int:
    """``seqpar verify --model NAME --nproc P``: print per case the loss difference and the largest
    gradient difference per parameter group; 1 if any is past tolerance (loss 1e-9, grads 1e-8)."""
    from seqpar.comm.launch import run_distributed
    from seqpar.integrations.models import check_model_name
    from seqpar.testing.model_parity import F32_RTOL, GRAD_TOL, LOSS_TOL, model_cases, row_ok, run_model_parity

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    check_model_name(args.model)
    cases = model_cases(args.model, args.strategy)
    rows = run_distributed(run_model_parity, args.nproc, cases, timeout=args.timeout)[0]
    if all("refused" in r for r in rows):
        print(f"{args.model}: REFUSED by seqpar.parallelize (it would be silently wrong under sequence parallelism)"
              f":\n{rows[0]['refused']}")
        return 1
    rows = [r for r in rows if "refused" not in r]
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
        print(f"(f32 rel: weights the model itself sums in float32 (measured on the reference), relative error,"
              f" tolerance {F32_RTOL:g})")
    worst_loss = max(r["loss_diff"] for r in rows)
    worst = max(rows, key=lambda r: r["grad_max"])
    print(f"\n{len(rows) - failed} passed, {failed} failed ({args.model}, P={args.nproc}, float64; tolerances loss "
          f"{LOSS_TOL:g}, grads {GRAD_TOL:g}); worst loss diff {worst_loss:.2e}, worst grad diff "
          f"{worst['grad_max']:.2e} ({worst['worst_param']})")
    return 1 if failed else 0


def verify_zoo(args: argparse.Namespace) -> int:
    """``seqpar verify --zoo --nproc P``: one line per family and strategy (the worst outcome over
    its batches, the largest loss and gradient differences); 1 if any is a mismatch or a crash."""
    from seqpar.comm.launch import run_distributed
    from seqpar.testing.zoo import run_zoo

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    rows = run_distributed(run_zoo, args.nproc, timeout=args.timeout)[0]
    print(f"{'family':<36} {'strategy':<8} {'outcome':<22} {'loss':>9} {'grads':>9}  detail")
    counts: dict[str, int] = {}
    for family in dict.fromkeys(r.family for r in rows):
        for strategy in dict.fromkeys(r.strategy for r in rows if r.family == family):
            mine = [r for r in rows if r.family == family and r.strategy == strategy]
            outcome = "/".join(dict.fromkeys(r.outcome for r in mine))
            counts[outcome] = counts.get(outcome, 0) + 1
            detail = next((r.detail for r in mine if r.detail), "").split("\n")
            reason = detail[1].strip() if len(detail) > 1 and "cannot parallelize" in detail[0] else detail[0]
            print(f"{family:<36} {strategy:<8} {outcome:<22} {max(r.loss_diff for r in mine):9.2e} "
                  f"{max(r.grad_max for r in mine):9.2e}  {reason[:150]}")
    bad = sum(n for o, n in counts.items() if "mismatch" in o or "crashed" in o)
    print(f"\n{len({r.family for r in rows})} families at P={args.nproc}: "
          + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) + " (family x strategy)")
    return 1 if bad else 0
