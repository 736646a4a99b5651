"""tp2 x sp2 vs sp4 vs tp4 at the same world size (4 gloo ranks), one model, one run (issue 46).

Per layout, on the most loaded rank: the peak memory of a training step (the weights and AdamW
states held before it plus the live-tensor probe's peak of its forward and backward:
:mod:`seqpar.testing.nd_memory`, the same on every run); the median wall time of a full step
(forward, backward, gradient sync, AdamW), the three models alternating step by step in the same
processes so that the machine's load falls on all alike (4 ranks share 2 cores here: a step's wall
time is all ranks' CPU time over 2); and the planner's bytes per rank per layer per dimension
(forward, :mod:`seqpar.planner.nd`: Ulysses' all-to-alls over sp, the two all-reduces of tp).
Ratios are to sp4. Run::

    .venv/bin/python benchmarks/bench_nd.py [--seq 4096] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import seqpar
from seqpar.comm.launch import run_distributed
from seqpar.integrations.models import build_model
from seqpar.planner import format_bytes
from seqpar.planner.nd import ModelShape, layout_bytes
from seqpar.testing.nd_memory import Layout, measure_layouts

CONFIG = dict(hidden_size=128, intermediate_size=448, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=16, vocab_size=4096)
LAYOUTS = {"tp2 x sp2": (("tp", 2), ("sp", 2)), "sp4": (("sp", 4),), "tp4": (("tp", 4), ("sp", 1))}


def _times(rank: int, world: int, seq: int, steps: int) -> dict[str, float]:
    """Median step time per layout, the three models alternating."""
    torch.set_num_threads(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids}
    runs = {}
    for name, mesh_kw in LAYOUTS.items():
        mesh = seqpar.init_mesh(device_type="cpu", **dict(mesh_kw))
        torch.manual_seed(0)
        model, _ = build_model("tiny-llama", dtype=torch.float32, max_position_embeddings=seq, **CONFIG)
        seqpar.parallelize(model, mesh)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), mesh)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(steps + 1):  # the first round warms up
        for name, (model, opt, mesh) in runs.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            model(**seqpar.shard_batch(batch, mesh)).loss.backward()
            seqpar.sync_gradients(model, mesh)
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.distributed.barrier()
            if i:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _worker(rank: int, world: int, seq: int, steps: int) -> dict:
    memory = measure_layouts(rank, world, {**CONFIG, "max_position_embeddings": seq}, seq,
                             [Layout(mesh) for mesh in LAYOUTS.values()])
    return {"memory": [m["before"] + m["step"] for m in memory], "times": _times(rank, world, seq, steps)}


def _bytes(seq: int) -> dict[str, dict[str, int]]:
    """The planner's forward bytes per rank per layer, per dimension, of each layout."""
    shape = ModelShape(hidden_size=128, intermediate_size=448, layers=2, heads=8, kv_heads=4, head_dim=16,
                       vocab_size=4096)
    out = {}
    for name, mesh in LAYOUTS.items():
        m = dict(mesh)
        per, _ = layout_bytes(shape, seq_len=seq, gpus_per_node=4, dtype_bytes=4, dp_replicate=1, dp_shard=1,
                              u=m["sp"], r=1, tp=m.get("tp", 1), ep=1, causal=True)
        out[name] = per
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096, help="tokens per step (default 4096)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout (default 5)")
    args = parser.parse_args()
    results = run_distributed(_worker, 4, args.seq, args.steps, timeout=1800, env={"OMP_NUM_THREADS": "1"})
    names = list(LAYOUTS)
    peak = {n: max(r["memory"][i] for r in results) for i, n in enumerate(names)}
    step = {n: max(r["times"][n] for r in results) for n in names}
    comm = _bytes(args.seq)
    base = "sp4"
    print(f"tiny Llama (hidden 128, 8 / 4 heads, 2 layers, vocabulary 4096), {args.seq} tokens, 4 gloo ranks, "
          f"float32; ratios to {base}")
    print("  bytes: per rank per layer, forward, the planner's (sp: Ulysses' all-to-alls; tp: its two all-reduces)")
    print(f"  {'layout':<10} {'peak/rank':>10} {'x':>6} {'step s':>8} {'x':>6} {'sp bytes':>10} {'tp bytes':>10}"
          f" {'sp+tp':>10} {'x':>6}")
    base_total = comm[base]["sp"] + comm[base]["tp"]
    for n in names:
        total = comm[n]["sp"] + comm[n]["tp"]
        print(f"  {n:<10} {format_bytes(peak[n]):>10} {peak[n] / peak[base]:>6.2f} {step[n]:>8.3f} "
              f"{step[n] / step[base]:>6.2f} {format_bytes(comm[n]['sp']):>10} {format_bytes(comm[n]['tp']):>10}"
              f" {format_bytes(total):>10} {total / base_total:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
