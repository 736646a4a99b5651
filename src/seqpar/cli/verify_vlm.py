"""``seqpar verify`` for vision-language models: a local VLM checkpoint with images
(``--model DIR``), or every image-text-to-text family of the installed transformers
(``--vlm-zoo``), each against the same model unsharded (float64, loss and every gradient, vision
tower included). Prints one line per family and strategy and the closing count of outcomes."""

from __future__ import annotations

import argparse
from collections import Counter

FAILED = ("mismatch", "crashed")
"""Outcomes that fail the command (silently wrong, or a bug); a refusal names its mechanism."""


def print_rows(rows: list) -> Counter:
    """The table (one line per family and strategy) and ``{family outcome: families}``."""
    from seqpar.integrations.vlm.families import FAMILIES

    print(f"{'family':<26} {'strategy':<8} {'outcome':<22} {'loss':>9} {'grads':>9}  mechanisms / detail")
    per_family: Counter = Counter()
    for family in dict.fromkeys(r.family for r in rows):
        mine = [r for r in rows if r.family == family]
        per_family["/".join(dict.fromkeys(r.outcome for r in mine))] += 1
        fam = FAMILIES.get(family)
        mechanisms = ", ".join(m.split(" (")[0] for m in fam.mechanisms) if fam else "(a checkpoint)"
        for r in mine:
            detail = r.detail.replace("\n", " ")
            print(f"{family:<26} {r.strategy:<8} {r.outcome:<22} {r.loss_diff:9.2e} {r.grad_max:9.2e}  "
                  f"{mechanisms}{' | ' + detail[:160] if detail else ''}")
    return per_family


def summary(rows: list, per_family: Counter, what: str, p: int, strict: bool = False) -> int:
    """Print the closing line; 1 on a mismatch or crash (``strict``: on anything but exact)."""
    worst = max(rows, key=lambda r: r.grad_max)
    print(f"\n{len(per_family)} {what} at P={p}: " + ", ".join(f"{n} {o}" for o, n in sorted(per_family.items()))
          + f" (families); worst loss diff {max(r.loss_diff for r in rows):.2e}, worst grad diff "
          f"{worst.grad_max:.2e} ({worst.family} {worst.strategy})")
    if strict:
        return 0 if all(r.outcome.startswith("exact") for r in rows) else 1
    return 1 if any(r.outcome in FAILED for r in rows) else 0


def verify_vlm_zoo(args: argparse.Namespace) -> int:
    """``seqpar verify --vlm-zoo --nproc P``: every class of transformers' image-text-to-text
    mapping, tiny and float64, with images: exact, exact (float32 model), refused (the mechanism
    named), or why it cannot run unsharded here; 1 if any is a mismatch or a crash."""
    from seqpar.comm.launch import run_distributed
    from seqpar.testing.vlm_parity import run_vlm_parity
    from seqpar.testing.vlm_zoo import vlm_types

    if args.nproc < 2:
        raise ValueError(f"--nproc must be >= 2 for --vlm-zoo (the SP degree), got {args.nproc}")
    strategies = ("ulysses",) if args.quick else ("ulysses", "ring")
    rows = run_distributed(run_vlm_parity, args.nproc, vlm_types(), strategies, timeout=args.timeout)[0]
    return summary(rows, print_rows(rows), "families", args.nproc)


def verify_vlm_model(args: argparse.Namespace) -> int:
    """``seqpar verify --model DIR`` for a vision-language checkpoint: its batch with images
    (rows of 1-2 images, a video where it takes one, a padded row) under ``--strategy``; 1 unless
    exact (a refusal names the mechanism seqpar cannot run)."""
    import json
    import os

    from seqpar.comm.launch import run_distributed
    from seqpar.integrations.vlm.families import FAMILIES
    from seqpar.testing.vlm_parity import run_vlm_parity
    from seqpar.testing.vlm_zoo import load_vlm

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    with open(os.path.join(args.model, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    print(f"{args.model}: {model_type}: {', '.join(m.split(' (')[0] for m in FAMILIES[model_type].mechanisms)}")
    rows = run_distributed(run_vlm_parity, args.nproc, [args.model], (args.strategy,), load_vlm,
                           timeout=args.timeout)[0]
    print("max |SP - non-SP| in float64 with images: loss, then every gradient (vision tower included)")
    return summary(rows, print_rows(rows), "checkpoint", args.nproc, strict=True)
