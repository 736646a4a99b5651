"""The README's picture: peak memory per rank of one training step against P, measured here.

One SFT step (forward, backward, ``seqpar.sync_gradients``, an SGD step) of a Llama-shaped model
(vocabulary 32,000, hidden 256, 2 layers, float32) on one row of ``--seq`` tokens, at P = 1, 2, 4
sequence-parallel ranks (gloo, fresh worker processes per P), with seqpar's memory switches
(``seqpar.reduce_memory``: tiled loss, tiled MLP, layer checkpoints) and without them. Per rank: the
peak of live tensor storage the step creates (:class:`seqpar.testing.memory.LiveMemory`: counted,
the same on every run and machine; the weights, gradients and optimizer state exist before the step
and are not in it). Printed: each point (the max over ranks) and the ratios against P = 1 and against
the switches off; written: ``docs/assets/memory_vs_p.png`` (``--out``). Run::

    .venv/bin/python benchmarks/plot_memory_vs_p.py            # 8k tokens, about a minute on 2 cores
    .venv/bin/python benchmarks/plot_memory_vs_p.py --quick    # tiny sizes, seconds (a smoke run)
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass
from pathlib import Path

import torch

import seqpar
from seqpar.comm.launch import run_distributed
from seqpar.integrations.models import build_model
from seqpar.testing.memory import MIB, LiveMemory

OUT = Path(__file__).resolve().parents[1] / "docs" / "assets" / "memory_vs_p.png"
PS = (1, 2, 4)


@dataclass(frozen=True)
class Sizes:
    """One row of ``seq`` tokens through a Llama shape of ``hidden`` x ``layers``, vocabulary ``vocab``."""

    seq: int = 8192
    hidden: int = 256
    layers: int = 2
    vocab: int = 32000

    def model(self) -> dict[str, int]:
        heads = max(4, self.hidden // 64)
        return dict(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.hidden * 7 // 2,
                    num_attention_heads=heads, num_key_value_heads=heads, head_dim=self.hidden // heads,
                    num_hidden_layers=self.layers, max_position_embeddings=self.seq)


QUICK = Sizes(seq=512, hidden=64, layers=1, vocab=2048)


def step_worker(rank: int, world: int, sizes: Sizes, switches: bool) -> dict[str, float]:
    """One training step's peak live storage on this rank (after a warm-up step), and its loss."""
    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    torch.manual_seed(0)
    model, _ = build_model("tiny-llama", **sizes.model())
    seqpar.parallelize(model, mesh)
    if switches:
        seqpar.reduce_memory(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, sizes.vocab, (1, sizes.seq), generator=g)  # [1, S]: the same on every rank
    batch = {"input_ids": ids, "labels": ids.clone()}

    def step() -> float:
        loss = model(**seqpar.shard_batch(batch, mesh)).loss  # each rank: [1, S/P] tokens
        loss.backward()
        seqpar.sync_gradients(model, mesh)
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: model state, not the step's
        return float(loss.detach())

    step()  # warm-up: the gradients and the batch's plans exist before the measured step
    gc.collect()
    with LiveMemory() as probe:
        loss = step()
    return {"peak_mib": probe.peak_bytes / MIB, "loss": loss}


def measure(sizes: Sizes) -> dict[bool, dict[int, dict[str, float]]]:
    """``{switches: {P: {peak_mib (max over ranks), loss (rank 0's)}}}``."""
    rows: dict[bool, dict[int, dict[str, float]]] = {}
    for switches in (False, True):
        rows[switches] = {}
        for p in PS:
            per_rank = run_distributed(step_worker, p, sizes, switches, timeout=1800, pg_timeout=900)
            rows[switches][p] = {"peak_mib": max(r["peak_mib"] for r in per_rank), "loss": per_rank[0]["loss"]}
    return rows


def report(rows: dict[bool, dict[int, dict[str, float]]], sizes: Sizes) -> list[str]:
    lines = []
    for switches, by_p in rows.items():
        name = "reduce_memory" if switches else "plain"
        for p, r in by_p.items():
            lines.append(f"{name:>13} P={p}: peak {r['peak_mib']:9.2f} MiB per rank  "
                         f"({r['peak_mib'] / by_p[1]['peak_mib']:.3f}x P=1)  loss {r['loss']:.6f}  "
                         f"({sizes.seq} tokens, {sizes.seq // p} per rank)")
    for p in PS:
        lines.append(f"reduce_memory / plain at P={p}: {rows[True][p]['peak_mib'] / rows[False][p]['peak_mib']:.3f}x")
    return lines


def plot(rows: dict[bool, dict[int, dict[str, float]]], sizes: Sizes, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for switches, style in ((False, "o-"), (True, "s-")):
        ys = [rows[switches][p]["peak_mib"] for p in PS]
        label = "seqpar.parallelize + reduce_memory" if switches else "seqpar.parallelize"
        ax.plot(PS, ys, style, label=label)
        for p, y in zip(PS, ys, strict=True):
            ax.annotate(f"{y:.0f}", (p, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    first = rows[False][1]["peak_mib"]
    ax.plot(PS, [first / p for p in PS], ":", color="gray", label="1/P of the first point")
    ax.set_xscale("log", base=2)
    ax.set_xticks(PS, [str(p) for p in PS])
    ax.set_xlabel("P (ranks sharing one sequence)")
    ax.set_ylabel("peak MiB per rank")
    ax.set_title(f"One training step, {sizes.seq:,} tokens, Llama shape (vocab {sizes.vocab:,})", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=Sizes.seq, help="tokens in the row")
    ap.add_argument("--out", type=Path, default=OUT, help="where the PNG goes")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = ap.parse_args(argv)
    sizes = QUICK if args.quick else Sizes(seq=args.seq)
    rows = measure(sizes)
    for line in report(rows, sizes):
        print(line, flush=True)
    plot(rows, sizes, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
