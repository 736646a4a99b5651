"""Peak memory per rank of a DPO step and a GRPO-style step at long lengths, sp=1 against sp=4, with
seqpar.reduce_memory's switches on (issue 36, item 9 and its memory criterion).

The model: Llama shape, vocabulary 32,000 (a [S, V] float32 tensor is 125 KiB per token), hidden
``--hidden``, ``--layers`` layers, float32. The steps, each through :mod:`seqpar.objectives`:

* DPO: one pair, chosen and rejected rows of ``--seq`` tokens each (a shared prompt of ``--prompt``
  tokens, then the completion); the reference log-probs from a frozen copy of the policy, run under
  no_grad on the same shards (``reference=``);
* GRPO-style: ``--group`` completions of ``--seq // 2`` tokens after the same prompt,
  ``PolicyGradient(loss_type="grpo", beta=0.04)`` with one advantage per completion and the same
  frozen reference for the KL term;

forward, backward, gradient sync and an SGD step, after a warm-up step (so gradients exist and the
policy has moved away from its reference: the losses printed at sp=1 and sp=4 are comparable; plain
SGD, because AdamW's first steps turn rounding-level gradient differences into whole steps). Each
(step, sp) runs in fresh worker processes. Per rank:

* step: the peak of live tensor storage the step creates (:class:`seqpar.testing.memory.LiveMemory`,
  counted, the same on every run): activations, the vocabulary tiles, the collectives' buffers and
  the gradients' temporaries; the model state (weights and gradients, the reference's weights) exists before the
  step and is printed apart (``state``: it does not depend on sp; FSDP shards it, not SP);
* rss: the peak resident set size above the baseline (allocator- and load-dependent, for reference).

Printed: both per (step, sp), the max over ranks, and the ratios sp=4 / sp=1 (goal for DPO: step
<= 0.35x), at reduce_memory's defaults. What shrinks less than the shard: the vocabulary tiles and
the tiled MLP's tile, which follow the shard within bounds (the objectives' default vocabulary tile
keeps its one [T, V] buffer within half the shard's hidden states, 64 tokens at least;
:func:`seqpar.batch.tiles.mlp_tile_for` keeps a [tile, I] intermediate within the shard's [T, H], at
most 2048 tokens: here 2048 tokens of every row at sp=1, 1170 at sp=4), and the head's weight
gradient ``[V, H]``, which does not shrink at all. Measured 2026-12-06 (2 shared cores, float32,
counted live storage): DPO 16k-token pairs 695.75 MiB at sp=1, 225.28 MiB at sp=4: 0.324x;
GRPO-style, 4 completions of 8k tokens: 759.38 / 225.28 MiB, 0.297x. The float32 losses at sp=1
and sp=4 are equal as printed (DPO 3.6330414, GRPO -0.2999585): the per-sequence sums of log-probs
accumulate in float64 and round once, so the order in which the ranks' parts arrive does not show.
``--mlp-tile`` sets a fixed MLP tile instead. Run::

    .venv/bin/python benchmarks/bench_objectives.py            # 16k-token pairs, a few minutes
    .venv/bin/python benchmarks/bench_objectives.py --quick    # tiny sizes, seconds (a smoke run)
"""

from __future__ import annotations

import argparse
import copy
import gc
from dataclasses import dataclass

import torch

import seqpar
from seqpar import objectives as O
from seqpar.bench.probes import peak_rss_mib, reset_peak_rss, rss_mib
from seqpar.comm.launch import run_distributed
from seqpar.integrations.models import build_model
from seqpar.testing.memory import MIB, LiveMemory

VOCAB = 32000
STEPS = ("dpo", "grpo")
DPO_GOAL = 0.35
KEYS = ("step_mib", "rss_mib", "state_mib", "largest_mib", "logits_mib")


@dataclass(frozen=True)
class Sizes:
    """One run's shapes: tokens per DPO row (``seq``), the shared prompt, the GRPO group size, the
    model's hidden size and layers, and the objectives' vocabulary tile (tokens; None: their default,
    :func:`seqpar.objectives.tokens.vocab_tile`)."""

    seq: int = 16384
    prompt: int = 1024
    group: int = 4
    hidden: int = 256
    layers: int = 2
    vocab: int = VOCAB
    tile: int | None = None
    dtype: str = "float32"
    mlp_tile: int | None = None  # reduce_memory's default: the tile follows the shard

    def model(self) -> dict[str, int]:
        heads = max(4, self.hidden // 64)
        return dict(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.hidden * 7 // 2,
                    num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=self.hidden // heads,
                    num_hidden_layers=self.layers, max_position_embeddings=self.seq)


QUICK = Sizes(seq=256, prompt=32, group=4, hidden=64, layers=1, vocab=4096)


def _rows(sizes: Sizes, step: str) -> dict[str, torch.Tensor]:
    """The batch: [chosen, rejected] (dpo) or the group's completions (grpo) after one shared prompt;
    labels ignore the prompt (-100), so only completion tokens count."""
    g = torch.Generator().manual_seed(2)
    n, seq = (2, sizes.seq) if step == "dpo" else (sizes.group, sizes.seq // 2)
    prompt = torch.randint(0, sizes.vocab, (1, sizes.prompt), generator=g).expand(n, -1)
    ids = torch.cat([prompt, torch.randint(0, sizes.vocab, (n, seq - sizes.prompt), generator=g)], 1)  # [n, seq]
    labels = ids.clone()
    labels[:, : sizes.prompt] = -100
    return {"input_ids": ids, "labels": labels}


def _objective(step: str, sizes: Sizes) -> tuple[O.Objective, dict[str, torch.Tensor]]:
    if step == "dpo":
        return O.DPO(beta=0.1), {}
    advantages = torch.linspace(-1.0, 1.0, sizes.group, dtype=torch.float32) + 0.3  # [N]: one per completion
    return O.PolicyGradient(loss_type="grpo", beta=0.04), {"advantages": advantages}


def _train_step(model, reference, opt, mesh, batch, objective, inputs, tile: int | None) -> float:
    out = objective(model, seqpar.shard_batch(batch, mesh), mesh, reference=reference, tile=tile, **inputs)
    out.loss.backward()
    seqpar.sync_gradients(model, mesh)
    opt.step()
    opt.zero_grad(set_to_none=False)  # the gradients stay allocated: model state, not the step's
    return float(out.loss.detach())


def _state_mib(model: torch.nn.Module, opt: torch.optim.Optimizer, reference: torch.nn.Module) -> float:
    """The model state: the policy's weights, gradients and AdamW moments, and the reference's weights."""
    tensors = [*model.parameters(), *reference.parameters()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) / MIB


def memory_worker(rank: int, world: int, step: str, sizes: Sizes) -> dict[str, float]:
    """One step's peak live storage and peak RSS above the model state, in fresh processes."""
    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    torch.manual_seed(0)
    model, _ = build_model("tiny-llama", dtype=getattr(torch, sizes.dtype), **sizes.model())
    seqpar.parallelize(model, mesh)
    seqpar.reduce_memory(model, mesh, mlp_tile=sizes.mlp_tile)  # tiled loss + MLP, checkpoint="layers"
    reference = copy.deepcopy(model).requires_grad_(False)  # frozen: parallelized, switches on
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # no moments: the measured losses compare across sp
    objective, inputs = _objective(step, sizes)
    warm = _rows(Sizes(seq=96, prompt=8, group=sizes.group, vocab=sizes.vocab), step)  # the same on every sp
    _train_step(model, reference, opt, mesh, warm, objective, inputs, sizes.tile)
    batch = _rows(sizes, step)
    gc.collect()
    base = rss_mib()
    reset_ok = reset_peak_rss()
    with LiveMemory() as probe:
        loss = _train_step(model, reference, opt, mesh, batch, objective, inputs, sizes.tile)
    local_tokens = batch["input_ids"].numel() // world
    return {"step_mib": probe.peak_bytes / MIB, "rss_mib": max(0.0, peak_rss_mib(reset_ok) - base),
            "largest_mib": probe.largest_bytes / MIB, "logits_mib": local_tokens * sizes.vocab * 4 / MIB,
            "state_mib": _state_mib(model, opt, reference), "loss": loss}


def measure(sizes: Sizes, nproc: int, steps: tuple[str, ...] = STEPS) -> dict[str, dict[int, dict[str, float]]]:
    """``{step: {sp: {step_mib, rss_mib, state_mib, loss}}}``, the max over ranks (the loss: rank 0's)."""
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for step in steps:
        rows[step] = {}
        for sp in (1, nproc):
            per_rank = run_distributed(memory_worker, sp, step, sizes, timeout=3600, pg_timeout=1800)
            rows[step][sp] = {k: max(r[k] for r in per_rank) for k in KEYS}
            rows[step][sp]["loss"] = per_rank[0]["loss"]
    return rows


def report(rows: dict[str, dict[int, dict[str, float]]], sizes: Sizes, nproc: int) -> list[str]:
    lines = []
    for step, by_sp in rows.items():
        tokens = 2 * sizes.seq if step == "dpo" else sizes.group * (sizes.seq // 2)
        for sp, r in by_sp.items():
            lines.append(f"{step:>4} sp={sp}: step {r['step_mib']:10.2f} MiB  rss {r['rss_mib']:10.2f} MiB  "
                         f"state {r['state_mib']:9.2f} MiB  largest tensor {r['largest_mib']:8.2f} MiB (the shard's "
                         f"[S, V] logits: {r['logits_mib']:9.2f} MiB)  loss {r['loss']:.7f}  "
                         f"(per rank, {tokens} tokens)")
        one, many = by_sp[1], by_sp[nproc]
        goal = f" (goal <= {DPO_GOAL})" if step == "dpo" else ""
        lines.append(f"{step:>4} sp={nproc}/sp=1: step {many['step_mib'] / one['step_mib']:.3f}x{goal}  "
                     f"rss {many['rss_mib'] / max(one['rss_mib'], 1e-9):.3f}x  step+state "
                     f"{(many['step_mib'] + many['state_mib']) / (one['step_mib'] + one['state_mib']):.3f}x")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Sizes()
    ap.add_argument("--seq", type=int, default=default.seq, help="tokens per DPO row (GRPO completions: half)")
    ap.add_argument("--prompt", type=int, default=default.prompt)
    ap.add_argument("--group", type=int, default=default.group, help="GRPO completions per prompt")
    ap.add_argument("--hidden", type=int, default=default.hidden)
    ap.add_argument("--layers", type=int, default=default.layers)
    ap.add_argument("--tile", type=int, default=None, help="tokens per vocabulary tile (default: the objectives')")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--mlp-tile", type=int, default=default.mlp_tile,
                    help="reduce_memory's mlp_tile (default: reduce_memory's, a tile that follows the shard)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    args = ap.parse_args(argv)
    sizes = QUICK if args.quick else Sizes(args.seq, args.prompt, args.group, args.hidden, args.layers, VOCAB,
                                           args.tile, args.dtype, args.mlp_tile)
    rows = measure(sizes, args.nproc, tuple(args.steps))
    for line in report(rows, sizes, args.nproc):
        print(line, flush=True)


if __name__ == "__main__":
    main()
