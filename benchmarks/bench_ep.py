"""Expert parallelism with SP: per-rank expert memory, step time and bytes moved, ep = 1, 2, 4 at sp = 4.

    python benchmarks/bench_ep.py            # ratios from one run; ~1-2 min on 2 shared cores
    python benchmarks/bench_ep.py --quick    # tiny sizes (the test's)

One Qwen3-MoE model (float32, 8 experts, top-2), one 4-rank gloo job, the same sequence sharded over
sp = 4; three layouts of the experts: replicated on every rank (ep = 1, plain SP), and sharded over
ep = 2 and ep = 4 ranks (folded over the sp ranks). For each: the bytes of expert parameters a rank
holds, the bytes the experts' all-to-alls move per step (the largest buffer of each call, summed),
and the step time (forward, backward, sync_gradients; the slowest rank's), over ``--repeat`` rounds
that alternate the layouts' order so that load from other jobs hits each alike; the median is
reported, as a ratio to ep = 1 in the same run. The three layouts must compute the same loss.

On this machine four ranks share two cores: a step's wall time follows the CPU seconds of all
ranks together, and the experts' FLOPs are the same in every layout (each row meets its experts
once), so the time ratio shows what the exchanges cost, not what EP saves on a GPU (where it trades
replicated expert weights, gradients and optimizer state, 1/ep of them per rank, for two
all-to-alls per MoE layer).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from seqpar.comm.launch import run_distributed

WORLD, EPS = 4, (1, 2, 4)


def _config(quick: bool):
    from transformers import Qwen3MoeConfig

    size = dict(hidden_size=64, moe_intermediate_size=64, vocab_size=256) if quick else dict(
        hidden_size=256, moe_intermediate_size=512, vocab_size=2048)
    return Qwen3MoeConfig(**size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=8, num_experts_per_tok=2, max_position_embeddings=65536, intermediate_size=512,
                          tie_word_embeddings=False)


def _worker(rank: int, world: int, quick: bool, seq: int, repeat: int) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import seqpar
    from seqpar.comm.counting import count_collective_bytes

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_config(quick), experts_implementation="eager").train()
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    groups = {ep: dist.new_subgroups_by_enumeration([list(range(i, i + ep)) for i in range(0, world, ep)])[0]
              for ep in EPS if ep > 1}
    models = {}
    for ep in EPS:
        model = AutoModelForCausalLM.from_config(_config(quick), experts_implementation="eager").train()
        model.load_state_dict(base.state_dict())
        seqpar.parallelize(model, mesh, ep=groups.get(ep))
        models[ep] = model
    ids = torch.randint(0, base.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    local = seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh)

    def step(model):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        loss = model(**local).loss
        loss.backward()
        seqpar.sync_gradients(model, mesh)
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(loss.detach()), float(took)

    out = {"expert_bytes": {}, "a2a_bytes": {}, "loss": {}, "times": {ep: [] for ep in EPS}}
    for ep, model in models.items():
        experts = [p for n, p in model.named_parameters() if ".experts." in n]
        out["expert_bytes"][ep] = sum(p.numel() * p.element_size() for p in experts)
        with count_collective_bytes() as moved:
            out["loss"][ep], _ = step(model)  # warm-up, and the bytes of one step
        out["a2a_bytes"][ep] = moved["all_to_all_single"]
    for r in range(repeat):
        order = EPS if r % 2 == 0 else EPS[::-1]
        for ep in order:
            out["times"][ep].append(step(models[ep])[1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--seq", type=int, default=None, help="tokens in the sequence (default 4096; quick 256)")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds (default 6; quick 2)")
    args = parser.parse_args()
    seq = args.seq or (256 if args.quick else 4096)
    repeat = args.repeat or (2 if args.quick else 6)
    out = run_distributed(_worker, WORLD, args.quick, seq, repeat, timeout=1800)[0]
    print(f"Qwen3-MoE, 8 experts top-2, {'quick' if args.quick else 'hidden 256'}, S={seq} over sp={WORLD}, "
          f"{repeat} rounds (median step, slowest rank)")
    base_time = statistics.median(out["times"][1])
    for ep in EPS:
        t = statistics.median(out["times"][ep])
        print(f"  ep={ep}: expert params {out['expert_bytes'][ep] / 2**20:8.3f} MiB/rank  all-to-all buffers "
              f"{out['a2a_bytes'][ep] / 2**20:8.3f} MiB/step  step {t * 1000:8.1f} ms  loss {out['loss'][ep]:.6f}")
    for ep in EPS[1:]:
        print(f"  ep={ep}/ep=1: expert params {out['expert_bytes'][ep] / out['expert_bytes'][1]:.3f}x  "
              f"step {statistics.median(out['times'][ep]) / base_time:.3f}x")
    spread = max(abs(out["loss"][ep] - out["loss"][1]) for ep in EPS)
    print(f"  loss spread over the layouts: {spread:.2e} (float32)")
    assert spread < 1e-4, spread


if __name__ == "__main__":
    main()
