"""Hybrid models' recurrent token mixers under SP, on local gloo processes, in one run:

    python benchmarks/bench_mixers.py             # one mixer layer: state passing / split by heads / gathered
    python benchmarks/bench_mixers.py --goals     # issue 28's table (below)

Layers (default, P = 2 and 4, S = 2048, hidden 256, float32): Gated DeltaNet (Qwen3-Next), Mamba2
with one group (Bamba), Mamba (Jamba); one layer forward + backward in each run mode, alternating
step by step, the median over repeats of the slowest rank, and the mode seqpar's choice picks (it
measures the two on 512 tokens per rank: seqpar.integrations.mixers.choice).

Goals (``--goals``): a Qwen3-Next-shaped model, hidden 256, 3 Gated DeltaNet layers + 1 attention
layer, against the same model with 4 attention layers; one forward + backward per step:

* per-rank peak memory (live tensor storage the step creates, :class:`seqpar.testing.memory.LiveMemory`:
  counted, the same on every run) at S = 8k and 16k, P = 4 / P = 1, hybrid (state passing, and split
  by heads) over attention-only -- issue 28's goal: state passing within 1.05x;
* the recurrent layer's activation bytes per rank (what its forward leaves for the backward) at
  P = 1, 2, 4, also over the layer's whole run at P = 1 (state passing recomputes its scan's kernel
  in backward, so it keeps less than the whole layer even at P = 1);
* bytes communicated per recurrent layer, forward + backward, at 4k and 16k tokens;
* step time of the hybrid at P = 4, state passing against split by heads, same inputs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from seqpar.comm.launch import run_distributed

FAMILIES = {  # a built-in or zoo model with the mixer, sized so that the mixer's compute shows
    "gated-deltanet (qwen3_next)": ("qwen3_next", {"hidden_size": 256, "linear_num_key_heads": 8,
                                                   "linear_num_value_heads": 16, "linear_key_head_dim": 32,
                                                   "linear_value_head_dim": 32}),
    "mamba2, one group (bamba)": ("bamba", {"attn_layer_indices": [1], "hidden_size": 256, "mamba_n_heads": 16,
                                            "mamba_d_head": 32, "mamba_expand": 2, "mamba_d_state": 32}),
    "mamba (jamba)": ("jamba", {"attn_layer_period": 2, "attn_layer_offset": 1, "hidden_size": 256,
                                "mamba_d_state": 16}),
}
MODES = ("state", "heads", "gather")
HYBRID = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
          "linear_key_head_dim": 32, "linear_value_head_dim": 32, "max_position_embeddings": 1 << 15,
          "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
ATTENTION_ONLY = {**HYBRID, "layer_types": ["full_attention"] * 4}
MIB = 2**20


def _mesh(world: int):
    import seqpar

    torch.set_num_threads(1)
    return seqpar.init_mesh(sp=world, device_type="cpu")


# --------------------------------------------------------------------------------------------
# one mixer layer in each mode
# --------------------------------------------------------------------------------------------

def _layers(rank: int, world: int, seq: int, repeats: int) -> dict:
    import seqpar
    from seqpar.batch.local_batch import BATCH_KWARG
    from seqpar.comm.mesh import axis_group
    from seqpar.integrations.mixers import family_of, run_token_mixer, token_mixers
    from seqpar.integrations.mixers.choice import choose
    from seqpar.testing.zoo import build_tiny

    mesh = _mesh(world)
    group = axis_group(mesh, "sp")
    out = {}
    for name, (model_type, overrides) in FAMILIES.items():
        model = build_tiny(model_type, **overrides).float()
        seqpar.parallelize(model, mesh)
        ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(1))
        local = seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh)
        _, mixer = token_mixers(model)[0]
        x = torch.randn(1, local["input_ids"].shape[1], model.config.hidden_size, requires_grad=True)
        batch = local[BATCH_KWARG]
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for step in range(repeats + 1):
            for mode in MODES:
                t0 = time.perf_counter()
                run_token_mixer(mixer, x, batch, group, mode=mode).sum().backward()
                if step:  # the first step warms up
                    times[mode].append(time.perf_counter() - t0)
        out[name] = {"times": {m: statistics.median(t) for m, t in times.items()},
                     "choice": choose(family_of(mixer), mixer, x, batch, group, {}).mode}
    return out


def layers(args: argparse.Namespace) -> None:
    print(f"S={args.seq}, one mixer layer forward + backward, float32, median of {args.repeats}, slowest rank")
    print(f"{'P':>2}  {'mixer':30} {'state ms':>9} {'heads ms':>9} {'gathered ms':>12} {'state/heads':>12}"
          f" {'chosen':>7}")
    for p in args.nproc:
        ranks = run_distributed(_layers, p, args.seq, args.repeats, timeout=3600, pg_timeout=1800,
                                env={"OMP_NUM_THREADS": "1"})
        for name in FAMILIES:
            ms = {m: max(r[name]["times"][m] for r in ranks) * 1e3 for m in MODES}
            print(f"{p:>2}  {name:30} {ms['state']:9.1f} {ms['heads']:9.1f} {ms['gather']:12.1f}"
                  f" {ms['state'] / ms['heads']:11.2f}x {ranks[0][name]['choice']:>7}")


# --------------------------------------------------------------------------------------------
# issue 28's goals
# --------------------------------------------------------------------------------------------

def _model(config: dict):
    from seqpar.integrations.models import build_model

    torch.manual_seed(0)
    model, _ = build_model("tiny-qwen3-next", dtype=torch.float32, **config)
    return model.train()


def _batch(seq: int) -> dict:
    ids = torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids}


def _steps(rank: int, world: int, seq: int, configs: list[tuple[str, str, str | None]], repeats: int) -> dict:
    """For each ``(label, model, mixer mode)``: the live-memory peak of one forward + backward (MiB,
    above what existed before it: weights, gradients) and the median step time over ``repeats``."""
    import torch.distributed as dist

    import seqpar
    from seqpar.integrations.mixers import set_mixer_mode
    from seqpar.testing.memory import LiveMemory

    mesh = _mesh(world)
    batch = _batch(seq)
    out = {}
    models = {}
    for label, which, mode in configs:
        model = models.get(which) or _model(HYBRID if which == "hybrid" else ATTENTION_ONLY)
        models[which] = model
        seqpar.parallelize(model, mesh)
        if mode is not None:
            set_mixer_mode(model, mode)
        local = seqpar.shard_batch(batch, mesh)
        model(**local).loss.backward()  # warm-up: gradients exist from here on
        gc.collect()
        with LiveMemory() as probe:
            model(**seqpar.shard_batch(batch, mesh)).loss.backward()
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            model(**seqpar.shard_batch(batch, mesh)).loss.backward()
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=False)
        seqpar.unparallelize(model)
        out[label] = {"mem_mib": probe.peak_bytes / MIB, "step_s": statistics.median(times)}
    return out


def _layer_bytes(rank: int, world: int, seq: int, modes: tuple[str, ...]) -> dict:
    """One Gated DeltaNet layer of the hybrid on this rank's shard, per mode: the bytes its forward
    leaves alive for the backward, and the bytes its collectives move forward + backward."""
    import seqpar
    from seqpar.batch.local_batch import BATCH_KWARG
    from seqpar.comm.counting import count_collective_bytes
    from seqpar.comm.mesh import axis_group
    from seqpar.integrations.mixers import run_token_mixer, token_mixers
    from seqpar.testing.memory import LiveMemory

    mesh = _mesh(world)
    model = _model(HYBRID)
    seqpar.parallelize(model, mesh)
    local = seqpar.shard_batch(_batch(seq), mesh)
    _, mixer = token_mixers(model)[0]
    out = {}
    for mode in modes:
        x = torch.randn(1, local["input_ids"].shape[1], HYBRID["hidden_size"], requires_grad=True)
        gc.collect()
        with LiveMemory() as probe, count_collective_bytes() as moved:
            y = run_token_mixer(mixer, x, local[BATCH_KWARG], axis_group(mesh, "sp"), mode=mode)
            kept = probe.live_bytes - y.untyped_storage().nbytes()  # what the backward will read
            y.sum().backward()
        out[mode] = {"kept_mib": kept / MIB, "moved_kib": sum(moved.values()) / 1024}
        del y, x
    return out


def goals(args: argparse.Namespace) -> None:
    """The cheap tables first (one layer each), the whole-model steps last: a run stopped early
    still has them."""
    big = max(args.goal_seqs)
    env, kw = {"OMP_NUM_THREADS": "1"}, {"timeout": 7200, "pg_timeout": 3600}
    print("issue 28's goals: Qwen3-Next shape, hidden 256, 3 Gated DeltaNet + 1 attention layers (hybrid) vs 4 "
          "attention layers; float32, forward + backward, one row", flush=True)
    print(f"\nrecurrent layer (one Gated DeltaNet layer) at S={big}: activation bytes its forward keeps for the "
          "backward, per rank")
    print("(vs whole: over the layer run whole at P=1, which split by heads does there)")
    print(f"{'P':>2} {'state MiB':>10} {'vs P=1':>7} {'vs whole':>9} {'heads MiB':>10} {'vs P=1':>7}", flush=True)
    kept = {}
    for p in (1, 2, 4):
        ranks = run_distributed(_layer_bytes, p, big, ("state", "heads"), env=env, **kw)
        kept[p] = {m: max(r[m]["kept_mib"] for r in ranks) for m in ("state", "heads")}
        print(f"{p:>2} {kept[p]['state']:10.2f} {kept[p]['state'] / kept[1]['state']:7.3f}"
              f" {kept[p]['state'] / kept[1]['heads']:9.3f} {kept[p]['heads']:10.2f}"
              f" {kept[p]['heads'] / kept[1]['heads']:7.3f}", flush=True)
    print("\nbytes communicated per recurrent layer (forward + backward, the largest rank), P=4")
    print(f"{'S':>6} {'state KiB':>10} {'heads KiB':>10}", flush=True)
    for s in (min(args.goal_seqs) // 2, big):
        ranks = run_distributed(_layer_bytes, 4, s, ("state", "heads"), env=env, **kw)
        print(f"{s:>6} {max(r['state']['moved_kib'] for r in ranks):10.1f} "
              f"{max(r['heads']['moved_kib'] for r in ranks):10.1f}", flush=True)
    print("\nper-rank peak memory (live tensor storage of one step, MiB) and step time (s, median)")
    print(f"{'S':>6} {'model':28} {'P=1':>9} {'P=4':>9} {'P=4/P=1':>8} {'/ attention':>11} {'step P=4 s':>10}",
          flush=True)
    for s in args.goal_seqs:
        one = run_distributed(_steps, 1, s, [("hybrid", "hybrid", None), ("attention", "attention", None)],
                              args.repeats, env=env, **kw)[0]
        four = run_distributed(_steps, 4, s, [("hybrid", "hybrid", "state"), ("hybrid-heads", "hybrid", "heads"),
                                              ("attention", "attention", None)], args.repeats, env=env, **kw)
        peak = {k: max(r[k]["mem_mib"] for r in four) for k in four[0]}
        step = {k: max(r[k]["step_s"] for r in four) for k in four[0]}
        attention = peak["attention"] / one["attention"]["mem_mib"]
        for label, base in (("hybrid, state passing", "hybrid"), ("hybrid, split by heads", "hybrid-heads"),
                            ("attention only", "attention")):
            ref = one["hybrid" if base != "attention" else "attention"]["mem_mib"]
            ratio = peak[base] / ref
            print(f"{s:>6} {label:28} {ref:9.1f} {peak[base]:9.1f} {ratio:8.3f} {ratio / attention:10.3f}x"
                  f" {step[base]:10.2f}")
        print(f"{s:>6} step time at P=4, state passing / split by heads: {step['hybrid'] / step['hybrid-heads']:.2f}x",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--goals", action="store_true", help="issue 28's table (see the module doc)")
    ap.add_argument("--goal-seqs", type=int, nargs="+", default=[8192, 16384])
    args = ap.parse_args()
    if args.goals:
        goals(args)
    else:
        layers(args)


if __name__ == "__main__":
    main()
