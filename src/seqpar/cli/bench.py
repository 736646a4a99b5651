"""``seqpar bench``: per-rank peak memory and step time of a training step at several sequence
lengths, on P ranks against 1 rank, per strategy. Writes a CSV and a PNG plot, prints the ratios
(memory per rank at N tokens on P ranks / memory at N tokens on 1 rank).

With ``--packing [DOC_LEN]``: every strategy on a plain causal row and on the same row packed with
DOC_LEN-token documents (position ids restart every DOC_LEN tokens), with the packed/plain ratios
and how memory grows when the length doubles (2: linear in S; 4: quadratic).

With ``--max-seq``: the longest sequence whose full step fits ``--mem-cap`` per rank, for each P and
set of memory switches (``--switches off,on``), found by running (bench_max_seq.csv / .png).

Locally every configuration runs in fresh gloo worker processes (CPU: peak live tensor memory above
what existed before the step, counted -- the same on every run -- and peak RSS beside it). Under
torchrun (GPUs: CUDA allocator peak) the job's world size is P, and the 1-rank numbers come from
every rank running the whole sequence alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .plan import parse_size
from .tables import num, write_csv

PACKING_SEQ_LENS = [4096, 8192, 16384, 32768]


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 2048,4096, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None: those depend on --packing and their help says so."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="peak memory and step time per rank, P ranks vs 1 (CSV + PNG)",
                       description=__doc__, formatter_class=_Help)
    p.add_argument("--model", default=None, help="built-in model config name; default tiny-llama sized as in "
                   "seqpar train, with --max-seq small-llama3 at its own size")
    p.add_argument("--model-config", default="", metavar="JSON", help="JSON config fields over the training size "
                   "(with --max-seq: over the built-in's own config); may set vocab_size")
    p.add_argument("--seq-lens", type=_ints, default=None, metavar="N,N,...",
                   help="sequence lengths (tokens per row); default 4096,8192,16384, with --packing "
                        + ",".join(map(str, PACKING_SEQ_LENS)))
    p.add_argument("--nproc", type=_ints, default=None, metavar="P,P,...",
                   help="rank counts to compare with 1; default 2,4, with --packing 2 (hybrid needs 4)")
    p.add_argument("--strategies", default="ulysses,ring,hybrid",
                   help="comma-separated: ulysses, ring, hybrid (hybrid only at P >= 4)")
    p.add_argument("--packing", type=int, nargs="?", const=512, default=0, metavar="DOC_LEN",
                   help="compare plain causal rows with rows packed with DOC_LEN-token documents (512 if no value "
                        "is given) instead of P ranks with 1; 0: off")
    p.add_argument("--max-seq", action="store_true",
                   help="instead: the longest sequence whose full step fits --mem-cap per rank, for each --nproc "
                        "(default 1,2,4) and --switches, found by running (bench_max_seq.csv / .png)")
    p.add_argument("--mem-cap", type=parse_size, default=2 * 2**30, metavar="SIZE",
                   help="with --max-seq: memory per rank above its runtime baseline, e.g. 2GiB or 800MiB")
    p.add_argument("--switches", default="off,on", metavar="SET,SET",
                   help="with --max-seq: memory switch sets to compare: off, on (tiled loss + tiled MLP + "
                        "checkpointed layers), or parts joined by + from loss, mlp, layers, offload")
    p.add_argument("--loss-tile", type=int, default=None, metavar="TOKENS",
                   help="with --max-seq: tokens per loss tile where the loss is tiled (default: reduce_memory's)")
    p.add_argument("--mlp-tile", type=int, default=None, metavar="TOKENS",
                   help="with --max-seq: tokens per MLP tile where the MLP is tiled (default: reduce_memory's)")
    p.add_argument("--precision", type=float, default=0.125,
                   help="with --max-seq: stop bisecting when the gap is below this fraction of the length")
    p.add_argument("--limit", type=int, default=1 << 22, help="with --max-seq: the longest length tried")
    p.add_argument("--start", type=int, default=None, metavar="TOKENS",
                   help="with --max-seq: the first length tried (default: the planner's prediction for the cap)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per configuration (after one untimed); default 3, with --packing 1")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"], help="model dtype")
    p.add_argument("--out", default="bench_out", help="directory for bench.csv and bench.png "
                   "(bench_packing.csv and bench_packing.png with --packing)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a configuration counts as hung")
    p.set_defaults(func=run)


def _cases(args: argparse.Namespace, strategies: list[str], nprocs: list[int]) -> tuple[list[Any], list[str]]:
    from seqpar import bench

    seq_lens = args.seq_lens or (PACKING_SEQ_LENS if args.packing else [4096, 8192, 16384])
    steps = args.steps if args.steps is not None else (1 if args.packing else 3)
    common = (args.model, args.model_config, seq_lens, nprocs, strategies, steps, args.dtype)
    if args.packing:
        return bench.packing_cases(*common, doc_len=args.packing)
    return bench.cases(*common), []


def run(args: argparse.Namespace) -> int:
    from seqpar import bench
    from seqpar.attention.dispatch import STRATEGIES

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"--strategies {args.strategies!r}: choose from {sorted(STRATEGIES)}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.packing < 0:
        raise ValueError(f"--packing takes a document length in tokens, got {args.packing}")
    if args.max_seq:
        if args.packing:
            raise ValueError("--max-seq and --packing are separate measurements: give one of them")
        from seqpar.train.launcher import under_torchrun

        if under_torchrun():
            raise ValueError("--max-seq starts fresh local processes for every trial (a rank over the cap is "
                             "stopped): run it without torchrun")
        from .max_seq import run_max_seq

        return run_max_seq(args, strategies, args.nproc or [1, 2, 4])
    args.model = args.model or "tiny-llama"
    cases, skipped = _cases(args, strategies, args.nproc or ([2] if args.packing else [2, 4]))
    if not cases:
        raise ValueError("nothing to measure: " + "; ".join(skipped))
    bench.check_cases(cases)
    from seqpar.train.launcher import under_torchrun

    if under_torchrun():
        import torch

        if not torch.cuda.is_available():
            if int(os.environ.get("RANK", 0)) != 0:
                return 2  # rank 0 says why
            raise ValueError("seqpar bench under torchrun measures the CUDA allocator; on CPU run it without "
                             "torchrun (it starts fresh processes for every configuration)")
        cases, skipped = _cases(args, strategies, [int(os.environ["WORLD_SIZE"])])
        rows = bench.torchrun_rows(cases)
        if rows is None:
            return 0  # not rank 0
    else:
        rows = []
        for c in cases:
            what = ("packed" if c.doc_len else "plain") if args.packing else ""
            print(f"  measuring P={c.nproc} {c.strategy if c.nproc > 1 else '':<8} seq_len={c.seq_len} {what}...",
                  file=sys.stderr, flush=True)
            rows.append(bench.run_case(c, timeout=args.timeout))
    os.makedirs(args.out, exist_ok=True)
    name = "bench_packing" if args.packing else "bench"
    csv_path, png_path = os.path.join(args.out, f"{name}.csv"), os.path.join(args.out, f"{name}.png")
    # plain rows against 1 rank, or --packing: packed against plain rows (ratios, fields, table, title, legend)
    if args.packing:
        ratios, fields, table, title = bench.add_packing_ratios, PACKING_CSV_FIELDS, format_packing_table, \
            f"seqpar bench --packing {args.packing}: {args.model} {args.dtype}, one training step"
        legend = (f"memory = peak per rank above what existed before the step ({rows[0]['measure']}); packed = "
                  f"{args.packing}-token documents per row; x2 = memory at S / memory at S/2 (2: linear, 4: quadratic)")
    else:
        ratios, fields, table, title = bench.add_ratios, CSV_FIELDS, format_table, \
            f"seqpar bench: {args.model} {args.dtype}, one training step per row"
        legend = (f"memory = peak per rank above an idle baseline ({rows[0]['measure']}); ratio = P ranks / 1 rank "
                  "at the same length")
    ratios(rows)
    write_csv(rows, csv_path, fields)
    plot(rows, png_path, title)
    print(table(rows))
    print(f"\n{legend}")
    for reason in skipped:
        print(f"skipped {reason}")
    print(f"wrote {os.path.abspath(csv_path)} and {os.path.abspath(png_path)}")
    return 0


# --------------------------------------------------------------------------------------------
# output: CSV, plot, tables
# --------------------------------------------------------------------------------------------

CSV_FIELDS = ["model", "strategy", "nproc", "seq_len", "tokens_per_rank", "mem_mib", "mem_ratio", "step_s",
              "time_ratio", "rss_mib", "mem_mib_per_rank", "measure", "dtype", "steps"]
PACKING_CSV_FIELDS = ["model", "strategy", "nproc", "seq_len", "doc_len", "tokens_per_rank", "mem_mib", "mem_ratio",
                      "growth", "step_s", "time_ratio", "rss_mib", "mem_mib_per_rank", "measure", "dtype", "steps"]
def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Memory per rank and step time against sequence length, one line per (P, strategy, packed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        label = r["strategy"] if r["nproc"] > 1 else "1 rank"
        series.setdefault((r["nproc"], label + (" packed" if r.get("doc_len") else "")), []).append(r)
    for (p, strat), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["seq_len"])
        label = strat if p == 1 else f"P={p} {strat}"
        xs = [r["seq_len"] for r in rs]
        ax_m.plot(xs, [r["mem_mib"] for r in rs], marker="o", label=label)
        ax_t.plot(xs, [r["step_s"] for r in rs], marker="o", label=label)
    for ax, what in ((ax_m, f"peak memory per rank (MiB, {rows[0]['measure']})"), (ax_t, "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'P':>2} {'strategy':<8} {'seq_len':>8} {'mem/rank MiB':>13} {'vs 1 rank':>9} {'step s':>8}"
            f" {'vs 1 rank':>9}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["seq_len"], r["nproc"], r["strategy"])):
        lines.append(f"{r['nproc']:>2} {r['strategy'] if r['nproc'] > 1 else '-':<8} {r['seq_len']:>8} "
                     f"{r['mem_mib']:>13.1f} {r['mem_ratio']:>9.3f} {r['step_s']:>8.3f} {r['time_ratio']:>9.3f}")
    return "\n".join(lines)


def format_packing_table(rows: list[dict[str, Any]]) -> str:
    """One line per (P, strategy, length): plain and packed memory per rank and step time, the
    packed/plain ratios and each series' growth over half the length."""
    head = (f"{'P':>2} {'strategy':<8} {'seq_len':>7} | {'plain MiB':>9} {'packed MiB':>10} {'ratio':>6} | "
            f"{'plain s':>8} {'packed s':>8} {'ratio':>6} | {'plain x2':>8} {'packed x2':>9}")
    lines = [head, "-" * len(head)]
    by: dict[tuple[int, str, int], dict[bool, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["nproc"], r["strategy"], r["seq_len"]), {})[bool(r["doc_len"])] = r
    for (p, strat, n), pair in sorted(by.items()):
        a, b = pair.get(False, {}), pair.get(True, {})  # plain, packed
        lines.append(
            f"{p:>2} {strat:<8} {n:>7} | {num(a.get('mem_mib'), '.1f', 9)} {num(b.get('mem_mib'), '.1f', 10)}"
            f" {num(b.get('mem_ratio'), '.2f', 6)} | {num(a.get('step_s'), '.3f', 8)}"
            f" {num(b.get('step_s'), '.3f', 8)} {num(b.get('time_ratio'), '.2f', 6)} |"
            f" {num(a.get('growth'), '.2f', 8)} {num(b.get('growth'), '.2f', 9)}")
    return "\n".join(lines)
