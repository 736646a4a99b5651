"""How evenly ring attention's causal work spreads over the ranks on packed rows, per layout.

    python benchmarks/bench_balance.py          # S = 32768, P = 2, 3, 4, 200 rows per setting

A packed row's documents have lengths drawn log-uniformly from 64 to S (the last one cut to fit).
Under causal attention a query at global position p of a document starting at s sees p - s + 1
keys, so a rank's work is the sum of that over the tokens the layout gives it. Printed: the mean
over rows of max/mean work per rank (1.00 is perfect balance), and the worst row, for the
contiguous and zigzag layouts (whole-row zigzag balances one long document, not many).
"""

from __future__ import annotations

import argparse
import math

import torch

from seqpar.attention.layout import layout_indices


def packed_row(seq: int, lo: int, g: torch.Generator) -> torch.Tensor:
    """``[S]`` position of each token within its document (documents back to back)."""
    pos, n = [], 0
    while n < seq:
        length = int(math.exp(math.log(lo) + torch.rand((), generator=g).item() * (math.log(seq) - math.log(lo))))
        length = min(length, seq - n)
        pos.append(torch.arange(length))
        n += length
    return torch.cat(pos)


def imbalance(within_doc: torch.Tensor, p: int, layout: str) -> float:
    """max / mean of the causal visible pairs per rank."""
    work = within_doc + 1  # keys a query sees: itself and the earlier tokens of its document
    per_rank = torch.stack([work[idx].sum() for idx in layout_indices(within_doc.numel(), p, layout)]).double()
    return float(per_rank.max() / per_rank.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--min-doc", type=int, default=64)
    args = parser.parse_args()
    print(f"causal ring work per rank, packed rows of {args.seq} tokens, documents log-uniform in "
          f"[{args.min_doc}, {args.seq}], {args.rows} rows: max/mean (mean over rows, worst row)")
    print(f"{'P':>2} {'contiguous':>18} {'zigzag':>18}")
    for p in (2, 3, 4):
        g = torch.Generator().manual_seed(p)
        rows = [packed_row(args.seq, args.min_doc, g) for _ in range(args.rows)]
        cells = []
        for layout in ("contiguous", "zigzag"):
            r = [imbalance(row, p, layout) for row in rows]
            cells.append(f"{sum(r) / len(r):8.3f} ({max(r):6.3f})")
        print(f"{p:>2} {cells[0]:>18} {cells[1]:>18}")


if __name__ == "__main__":
    main()
