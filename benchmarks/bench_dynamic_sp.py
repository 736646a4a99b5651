"""Dynamic SP schedule vs static sp=4: step time on the same rows, 4 gloo ranks, a tiny Llama.

    python benchmarks/bench_dynamic_sp.py            # ratios from one run; ~2-3 min on 2 shared cores

Two mixes, each one step of the same rows under both schedules (same tokens per step, same token
budget per rank per bin):
  long-tailed   lognormal lengths (mean ~512 tokens, capped at 8192), fixed seed
  all-long      every row 8192 tokens: nothing to gain, shows the schedule's overhead

First the cost model is refitted on this machine (degree-1 bins of two sizes for the compute
constants, all-to-alls of two sizes at degree 4 for the link); then each schedule's predicted step
time is printed beside the measured one (the fastest of ``--repeat`` steps -- on a shared machine
contention only adds -- static and dynamic alternating, each step's time the slowest rank's).
"""

from __future__ import annotations

import argparse
import time

import torch

from seqpar.comm.launch import run_distributed

WORLD = 4
MAX_LEN = 8192


def lognormal_lengths(n: int, *, mean: float, cap: int, seed: int) -> list[int]:
    """``n`` lengths ~ lognormal(mu, sigma=1.2) with mean ``mean`` before the cap, in [16, cap]."""
    sigma = 1.2
    mu = torch.log(torch.tensor(mean)).item() - sigma ** 2 / 2
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(mu + sigma * torch.randn(n, generator=g, dtype=torch.float64))
    return [int(min(max(16, round(float(x))), cap)) for x in draws]


def _rows(lengths: list[int], vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g)
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def _timed(fn, group) -> float:
    import torch.distributed as dist

    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - t0


def _fit_cost(model, shapes, mesh):
    """This machine's constants: degree-1 forward + backward of two bin sizes, all-to-alls of two sizes."""
    import torch.distributed as dist

    import seqpar
    from seqpar.comm.degrees import degree_meshes
    from seqpar.planner.bins import pack_rows
    from seqpar.planner.work import fit_machine

    one = degree_meshes(mesh).mesh(1)
    samples = []
    for n in (512, 2048, MAX_LEN):  # the longest one is mostly attention
        batch = pack_rows(_rows([n], shapes.vocab_size, n))
        run = lambda b=batch: model(**seqpar.shard_batch(b, one)).loss.backward()  # noqa: E731
        run()
        samples.append(([n], min(_timed(run, None) for _ in range(3))))
    group = mesh.get_group("sp")
    times = []
    for n in (1024, 8192):
        x = torch.randn(n * shapes.heads * shapes.head_dim)
        out = torch.empty_like(x)
        times.append(min(_timed(lambda x=x, out=out: dist.all_to_all_single(out, x, group=group), group)
                         for _ in range(5)))
        sizes = [x.numel() * 4 * 3 / 4]  # bytes leaving this rank
        times[-1] = (sizes[0], times[-1])
    # every rank must plan with the same cost model (else the schedules differ and plan() refuses):
    # the measurements are averaged over the ranks before the fit
    measured = torch.tensor([s for _, s in samples] + [t for _, t in times], dtype=torch.float64)
    dist.all_reduce(measured)
    measured = (measured / dist.get_world_size()).tolist()
    samples = [(d, measured[i]) for i, (d, _) in enumerate(samples)]
    times = [(b, measured[len(samples) + i]) for i, (b, _) in enumerate(times)]
    (b0, t0), (b1, t1) = times
    bandwidth = (b1 - b0) / max(t1 - t0, 1e-9)
    latency = max(t0 - b0 / bandwidth, 0.0)
    return fit_machine(samples, shapes, bytes_per_s=bandwidth, collective_s=latency)


def _step(model, mesh, dyn, rows) -> tuple[float, object]:
    import seqpar

    def run():
        step = dyn.plan(rows)
        for local in step:
            model(**local).loss.backward()
        seqpar.sync_gradients(model, mesh)
        model.zero_grad(set_to_none=True)
        run.schedule = step.schedule

    elapsed = _timed(run, None)
    return elapsed, run.schedule


def _worker(rank: int, world: int, repeat: int) -> dict:
    torch.set_num_threads(1)
    import functools

    import seqpar
    from seqpar.integrations.models import build_model
    from seqpar.planner.bins import DynamicSP
    from seqpar.planner.work import Shapes, bin_seconds

    torch.manual_seed(0)
    model, _ = build_model("tiny-llama", dtype=torch.float32)
    cfg = model.config
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    seqpar.parallelize(model, mesh)
    shapes = Shapes(heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                    hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                    layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size, dtype_bytes=4)
    machine = _fit_cost(model, shapes, mesh)
    cost = functools.partial(bin_seconds, shapes=shapes, machine=machine)
    budget = MAX_LEN // world  # tokens per rank per bin: an 8k row needs all 4 ranks
    schedules = {"dynamic": DynamicSP(mesh, token_budget=budget, cost=cost),
                 "static": DynamicSP(mesh, token_budget=budget, cost=cost, degrees=(world,))}
    tail = lognormal_lengths(48, mean=512, cap=MAX_LEN, seed=37)
    mixes = {"long-tailed": tail, "all-long": [MAX_LEN] * max(1, round(sum(tail) / MAX_LEN))}
    out: dict = {"machine": machine}
    for mix, lengths in mixes.items():
        rows = _rows(lengths, cfg.vocab_size, seed=1)
        times: dict[str, list[float]] = {"static": [], "dynamic": []}
        plans = {}
        for i in range(repeat + 1):  # the first round warms up
            for name in ("static", "dynamic") if i % 2 == 0 else ("dynamic", "static"):
                t, plans[name] = _step(model, mesh, schedules[name], rows)
                if i:
                    times[name].append(t)
        out[mix] = {"tokens": sum(lengths), "rows": len(lengths),
                    **{name: (min(ts), plans[name].predicted_step_s, dict(plans[name].rows_at_degree))
                       for name, ts in times.items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="timed steps per schedule and mix (default 3)")
    args = ap.parse_args()
    res = run_distributed(_worker, WORLD, args.repeat, timeout=1800)[0]
    m = res["machine"]
    print(f"cost model refitted here: linear {m.flops_per_s / 1e9:.2f} GFLOP/s, attention "
          f"{m.attention_flops_per_s / 1e9:.2f} GFLOP/s, {m.bytes_per_s / 1e6:.0f} MB/s, "
          f"collective {m.collective_s * 1e3:.2f} ms, per bin {m.bin_s * 1e3:.1f} ms")
    print(f"{'mix':<12} {'schedule':<8} {'rows at degree':<26} {'measured':>9} {'predicted':>9}")
    for mix in ("long-tailed", "all-long"):
        r = res[mix]
        for name in ("static", "dynamic"):
            t, p, hist = r[name]
            text = ", ".join(f"sp={k}: {n}" for k, n in sorted(hist.items()))
            print(f"{mix:<12} {name:<8} {text:<26} {t:>8.3f}s {p:>8.3f}s")
        ratio, pred = r["dynamic"][0] / r["static"][0], r["dynamic"][1] / r["static"][1]
        target = 0.75 if mix == "long-tailed" else 1.02
        print(f"{mix:<12} dynamic / static: measured {ratio:.3f}x, predicted {pred:.3f}x "
              f"(target <= {target}x: {'met' if ratio <= target else 'MISSED'}; "
              f"{r['rows']} rows, {r['tokens']} tokens)")


if __name__ == "__main__":
    main()
