"""How evenly ring attention's causal work spreads over the ranks on packed rows, per layout.

    python benchmarks/bench_balance.py             # S = 32768, P = 2, 3, 4, 200 batches of 1 row
    python benchmarks/bench_balance.py --batch 4   # batches of 4 rows sharing one permutation

A packed row's documents have lengths drawn log-uniformly from 64 to S (the last one cut to fit).
Under causal attention a query at global position p of a document starting at s sees p - s + 1
keys, so a rank's work is the sum of that over the tokens the layout gives it (over every row of
the batch: one permutation serves the whole batch). Printed: the mean over batches of max/mean
work per rank (1.00 is perfect balance), and the worst batch, for the contiguous, zigzag and
doc-zigzag layouts (whole-row zigzag balances one long document, not many; doc-zigzag cuts the
sequence wherever a row's document starts, see seqpar.attention.layout).
"""

from __future__ import annotations

import argparse
import math

import torch

from seqpar.attention.layout import document_cuts, layout_indices

LAYOUTS = ("contiguous", "zigzag", "doc-zigzag")


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
    """max / mean of the causal visible pairs per rank; ``within_doc`` ``[B, S]``."""
    work = (within_doc + 1).sum(0)  # [S] keys the queries at a position see, summed over the rows
    segments = (within_doc == 0).cumsum(1)  # [B, S] document id of each token
    cuts = document_cuts(segments) if layout == "doc-zigzag" else None
    per_rank = torch.stack([work[idx].sum() for idx in layout_indices(work.numel(), p, layout, cuts=cuts)])
    return float(per_rank.double().max() / per_rank.double().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=200, help="batches per setting")
    parser.add_argument("--batch", type=int, default=1, help="rows per batch (one permutation for all of them)")
    parser.add_argument("--min-doc", type=int, default=64)
    args = parser.parse_args()
    print(f"causal ring work per rank, packed rows of {args.seq} tokens, documents log-uniform in "
          f"[{args.min_doc}, {args.seq}], {args.rows} batches of {args.batch} row(s): max/mean "
          "(mean over batches, worst batch)")
    print(f"{'P':>2}" + "".join(f" {name:>18}" for name in LAYOUTS))
    for p in (2, 3, 4):
        g = torch.Generator().manual_seed(p)
        batches = [torch.stack([packed_row(args.seq, args.min_doc, g) for _ in range(args.batch)])
                   for _ in range(args.rows)]
        cells = []
        for layout in LAYOUTS:
            r = [imbalance(b, p, layout) for b in batches]
            cells.append(f"{sum(r) / len(r):8.3f} ({max(r):6.3f})")
        print(f"{p:>2}" + "".join(f" {c:>18}" for c in cells))


if __name__ == "__main__":
    main()
