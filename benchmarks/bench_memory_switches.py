"""Peak memory per rank and step time with seqpar.reduce_memory's switches off vs all on (issue 11).

The issue's model: Llama shape, hidden 128, 2 layers, vocabulary 32,000, float32; one row of
``--seq`` tokens (16k by default) over P=2 Ulysses ranks; one full training step (forward, backward,
gradient sync, AdamW) after a short warm-up step, so weights, gradients and optimizer states exist.
Each configuration runs in fresh worker processes. Per rank:

* live: the peak of live tensor storage the step creates (:class:`seqpar.testing.memory.LiveMemory`,
  counted, the same on every run);
* rss: the peak resident set size above the baseline (``/proc/self/clear_refs``, as ``seqpar bench``);
* step / cpu: the median wall and process CPU time of a step, measured in one more pair of processes
  that hold both models and alternate their steps (the machine's load falls on both alike).

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
from seqpar.bench.probes import peak_rss_mib, reset_peak_rss, rss_mib
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


def _build(mesh, seq: int, switches: dict | None):
    """The model (same weights every time) with or without the switches, its optimizer, after a warm-up step."""
    torch.manual_seed(0)
    model, _ = build_model("tiny-llama", dtype=torch.float32, max_position_embeddings=seq, **MODEL)
    seqpar.parallelize(model, mesh)
    if switches is not None:
        seqpar.reduce_memory(model, mesh, **switches)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    warm = torch.randint(0, MODEL["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(1))
    _step(model, opt, mesh, {"input_ids": warm, "labels": warm})
    return model, opt


def _batch(seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, MODEL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids}


def memory_worker(rank: int, world: int, switches: dict | None, seq: int) -> dict[str, float]:
    """Peak live storage and peak RSS of one step, in fresh processes (RSS never goes back down)."""
    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    model, opt = _build(mesh, seq, switches)
    batch = _batch(seq)
    gc.collect()
    base = rss_mib()
    reset_ok = reset_peak_rss()
    with LiveMemory() as probe:
        _step(model, opt, mesh, batch)
    return {"live_mib": probe.peak_bytes / MIB, "rss_mib": max(0.0, peak_rss_mib(reset_ok) - base)}


def time_worker(rank: int, world: int, configs: dict[str, dict | None], seq: int, steps: int
                ) -> dict[str, dict[str, float]]:
    """Median wall and CPU time per step of each configuration, their steps interleaved in one
    process so that the load of the machine falls on all of them alike."""
    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    built = {name: _build(mesh, seq, switches) for name, switches in configs.items()}
    batch = _batch(seq)
    wall: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(steps):
        for name, (model, opt) in built.items():
            torch.distributed.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            _step(model, opt, mesh, batch)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {name: {"step_s": statistics.median(wall[name]), "cpu_s": statistics.median(cpu[name])} for name in configs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per configuration (median)")
    args = ap.parse_args()
    configs = {"off": None, "all on": {}}  # {}: reduce_memory's defaults (tiled loss + MLP, checkpoint=layers)
    rows: dict[str, dict[str, float]] = {}
    for name, switches in configs.items():
        per_rank = run_distributed(memory_worker, args.nproc, switches, args.seq, timeout=3600)
        rows[name] = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    per_rank = run_distributed(time_worker, args.nproc, configs, args.seq, args.steps, timeout=7200)
    for name in configs:
        rows[name].update({k: max(r[name][k] for r in per_rank) for k in ("step_s", "cpu_s")})
        r = rows[name]
        print(f"{name:>7}: live {r['live_mib']:9.1f} MiB  rss {r['rss_mib']:9.1f} MiB  step {r['step_s']:7.2f} s  "
              f"cpu {r['cpu_s']:7.2f} s   (max over {args.nproc} ranks, {args.seq} tokens)", flush=True)
    off, on = rows["off"], rows["all on"]
    print(f"all on / off: live {on['live_mib'] / off['live_mib']:.3f}x  rss {on['rss_mib'] / off['rss_mib']:.3f}x "
          f"(goal <= 0.25)  step time {on['step_s'] / off['step_s']:.3f}x  cpu time {on['cpu_s'] / off['cpu_s']:.3f}x "
          "(goal <= 1.35)")


if __name__ == "__main__":
    main()
