"""Peak memory per rank and step time with seqpar.reduce_memory's switches off vs all on (issue 11).

The issue's model: Llama shape, hidden 128, 2 layers, vocabulary 32,000, float32; one row of
``--seq`` tokens (16k by default) over P=2 Ulysses ranks; one full training step (forward, backward,
gradient sync, AdamW) after a short warm-up step, so weights, gradients and optimizer states exist.
Each configuration runs in fresh worker processes. Per rank:

* live: the peak of live tensor storage the step creates (:class:`seqpar.testing.memory.LiveMemory`,
  counted, the same on every run);
* rss: the peak resident set size above the baseline (``/proc/self/clear_refs``, as ``seqpar bench``);
* step: the median wall time of the timed steps (the probe's step is not timed).

Goals: all-on / off <= 0.25 in memory, <= 1.35 in step time. Run::

    .venv/bin/python benchmarks/bench_memory_switches.py [--seq 16384] [--nproc 2] [--steps 2]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import seqpar
from seqpar.bench import _peak_rss_mib, _reset_peak_rss, _rss_mib
from seqpar.comm.launch import run_distributed
from seqpar.integrations.models import build_model
from seqpar.testing.memory import MIB, LiveMemory

MODEL = dict(vocab_size=32000, hidden_size=128, intermediate_size=448, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, num_hidden_layers=2)


def _step(model, opt, mesh, batch):
    model(**seqpar.shard_batch(batch, mesh)).loss.backward()
    seqpar.sync_gradients(model, mesh)
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(rank: int, world: int, switches: dict | None, seq: int, steps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    torch.manual_seed(0)
    model, _ = build_model("tiny-llama", dtype=torch.float32, max_position_embeddings=seq, **MODEL)
    seqpar.parallelize(model, mesh)
    if switches is not None:
        seqpar.reduce_memory(model, mesh, **switches)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    warm = torch.randint(0, MODEL["vocab_size"], (1, 64), generator=g)
    _step(model, opt, mesh, {"input_ids": warm, "labels": warm})
    ids = torch.randint(0, MODEL["vocab_size"], (1, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    gc.collect()
    base = _rss_mib()
    reset_ok = _reset_peak_rss()
    with LiveMemory() as probe:
        _step(model, opt, mesh, batch)
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        _step(model, opt, mesh, batch)
        times.append(time.perf_counter() - t0)
    return {"live_mib": probe.peak_bytes / MIB, "rss_mib": max(0.0, _peak_rss_mib(reset_ok) - base),
            "step_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per configuration (median)")
    args = ap.parse_args()
    configs = {"off": None, "all on": {}}  # {}: reduce_memory's defaults (tiled loss + MLP, checkpoint=layers)
    rows = {}
    for name, switches in configs.items():
        per_rank = run_distributed(worker, args.nproc, switches, args.seq, args.steps, timeout=3600)
        rows[name] = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        print(f"{name:>7}: live {rows[name]['live_mib']:9.1f} MiB  rss {rows[name]['rss_mib']:9.1f} MiB  "
              f"step {rows[name]['step_s']:7.3f} s   (max over {args.nproc} ranks, {args.seq} tokens)", flush=True)
    off, on = rows["off"], rows["all on"]
    print(f"all on / off: live {on['live_mib'] / off['live_mib']:.3f}x  rss {on['rss_mib'] / off['rss_mib']:.3f}x "
          f"(goal <= 0.25)  step time {on['step_s'] / off['step_s']:.3f}x (goal <= 1.35)")


if __name__ == "__main__":
    main()
