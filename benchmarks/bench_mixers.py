"""Hybrid models' recurrent token mixers under SP: split by heads (or Jamba's inner channels) against
gathered (every rank runs the whole layer), one mixer layer forward + backward on the same inputs, in
one run, on local gloo processes.

    python benchmarks/bench_mixers.py                 # P = 2 and 4, S = 2048, hidden 256, float32

Families: Gated DeltaNet (Qwen3-Next), Mamba2 with one group (Bamba: heads split, the group's norm
summed across ranks), Mamba (Jamba: inner channels split, x_proj summed). Each rank alternates the
two approaches step by step; the figure is the median over repeats of the slowest rank, printed as
split / gathered. Both are exact (tests/integrations/test_token_mixers.py); gathered repeats the
layer's compute on every rank, split divides it (the input is gathered whole in both).
"""

from __future__ import annotations

import argparse
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


def _work(rank: int, world: int, seq: int, repeats: int) -> dict:
    import seqpar
    from seqpar.batch.sharding import BATCH_KWARG
    from seqpar.comm.mesh import axis_group
    from seqpar.integrations.mixers import GATHER, HEADS, run_token_mixer, token_mixers
    from seqpar.testing.zoo import build_tiny

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    group = axis_group(mesh, "sp")
    out = {}
    for name, (model_type, overrides) in FAMILIES.items():
        model = build_tiny(model_type, **overrides).float()
        seqpar.parallelize(model, mesh)
        ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(1))
        local = seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh)
        _, mixer = token_mixers(model)[0]
        x = torch.randn(1, local["input_ids"].shape[1], model.config.hidden_size, requires_grad=True)
        times: dict[str, list[float]] = {"split": [], "gathered": []}
        for step in range(repeats + 1):
            for approach, mode in (("split", HEADS), ("gathered", GATHER)):
                t0 = time.perf_counter()
                run_token_mixer(mixer, x, local[BATCH_KWARG], group, mode=mode).sum().backward()
                if step:  # the first step warms up
                    times[approach].append(time.perf_counter() - t0)
        out[name] = {a: statistics.median(t) for a, t in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"S={args.seq}, one mixer layer forward + backward, float32, median of {args.repeats}, slowest rank")
    print(f"{'P':>2}  {'mixer':30} {'split ms':>9} {'gathered ms':>12} {'split / gathered':>17}")
    for p in args.nproc:
        ranks = run_distributed(_work, p, args.seq, args.repeats, timeout=1800, env={"OMP_NUM_THREADS": "1"})
        for name in FAMILIES:
            split = max(r[name]["split"] for r in ranks) * 1e3
            gathered = max(r[name]["gathered"] for r in ranks) * 1e3
            print(f"{p:>2}  {name:30} {split:9.1f} {gathered:12.1f} {split / gathered:16.2f}x")


if __name__ == "__main__":
    main()
