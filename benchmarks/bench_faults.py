"""What telling every rank of a fault costs, and how fast it is: (1) the steady-state cost of seqpar's
collectives waiting in slices and reading the fault channel between them (:mod:`seqpar.comm.waits`),
against plain blocking waits, on a stack of Ulysses / ring attention layers, forward + backward; (2)
the time from one rank's fault to every rank having raised, in a user's parallelize loop, at each
place of a step (:mod:`seqpar.testing.user_loop`), and with the failing rank living on after a fault in
the forward or the backward (:mod:`seqpar.testing.fault_modes`), on forked jobs (:mod:`seqpar.testing.zygote`).

    python benchmarks/bench_faults.py                    # P = 2, S = 1024 and 8192; latency at P = 2, 3, 4
    python benchmarks/bench_faults.py --skip-latency     # the steady-state ratios only

Steady state: each rank alternates "channel on" (as shipped) and "channel off" (the waits see no
channel: one blocking ``work.wait()``) step by step; the figure is the median over repeats of the
slowest rank, printed as a ratio (on / off). A collective that completes within its first slice
never touches the store, so the ratio should be 1 up to noise.

Measured 2026-12-02 (2 shared CPU cores, load average 12-15, ``--seq 1024,4096 --repeats 7``): on / off
0.89 and 0.99 (ulysses), 1.22 and 0.84 (ring) -- noise either way, no cost measurable here; the
fault reached every rank in 0.02-0.27 s at P = 2, 0.03-0.23 s at P = 3, 0.04-0.75 s at P = 4.

Measured 2026-12-05 (same machine, ``--seq 1024,4096 --repeats 5``): on / off 1.01 / 1.02 (ulysses),
0.98 / 1.03 (ring); the failing process ending: 0.01-0.03 s at every place, P = 2, 3, 4; the failing
rank catching its exception and living on (issue 38): forward 0.50 s and backward 0.50-0.51 s at P =
2, 3 and 4 -- one wait slice (``waits.SLICE_S``), where the peers first read the channel.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from seqpar.comm.launch import run_distributed

VARIANTS = ("channel on", "channel off")
PRELOAD = ("seqpar", "transformers", "seqpar.integrations.models", "transformers.models.llama.modeling_llama",
           "torch.distributed.checkpoint")


def _work(rank: int, world: int, seqs: list[int], heads: int, dim: int, layers: int, repeats: int) -> dict:
    import seqpar.attention.ring as ring_module
    import seqpar.attention.ulysses as ulysses_module
    import seqpar.comm.faults as faults
    from seqpar.attention.shard import SeqShard

    torch.set_num_threads(1)
    real_channel = faults.channel

    def use(variant: str) -> None:
        faults.channel = real_channel if variant == "channel on" else (lambda: None)

    out = {}
    for s in seqs:
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, s // world, heads, dim, generator=g, requires_grad=True) for _ in range(3))
        shard = SeqShard((s // world,) * world)
        for strategy, fn in (("ulysses", ulysses_module.ulysses_attention), ("ring", ring_module.ring_attention)):
            times: dict[str, list[float]] = {n: [] for n in VARIANTS}
            for _ in range(repeats):
                for name in VARIANTS:
                    use(name)
                    dist.barrier()
                    t0 = time.perf_counter()
                    x = q
                    for _ in range(layers):
                        x = fn(x, k, v, group=dist.group.WORLD, causal=True, shard=shard, validate=False)
                    x.sum().backward()
                    t = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    times[name].append(float(t))
            out[(s, strategy)] = {n: statistics.median(ts) for n, ts in times.items()}
    use("channel on")
    return out


def _latency(world: int, places: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """Per place (the last rank failing at step 1): seconds from the fault to the last rank raising,
    and the whole job's seconds (model build and 3 steps included)."""
    from seqpar.testing.fault_inject import Case, outcome_problems
    from seqpar.testing.user_loop import user_loop
    from seqpar.testing.zygote import Zygotes

    out = {}
    with Zygotes(world, preload=PRELOAD) as z:
        for place in places:
            case = Case(place, rank=world - 1)
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                outs = z.run(user_loop, case, d, timeout=120, pg_timeout=60)
                job = time.perf_counter() - t0
            problems = outcome_problems(case, outs)
            if problems:
                raise RuntimeError(f"{case.label()}: {problems}")
            out[place] = (max(o.t for o in outs) - outs[case.rank].t_fault, job)
    return out


def _lives_on(world: int) -> dict[str, tuple[float, float]]:
    """Forward and backward (the last rank failing at step 1 and living on, :mod:`seqpar.testing.fault_modes`):
    seconds from the fault to every other rank raised, and the job's seconds."""
    from seqpar.testing.fault_inject import Case
    from seqpar.testing.fault_modes import fault_mode_loop, latency, mode_problems
    from seqpar.testing.zygote import Zygotes

    out = {}
    with Zygotes(world, preload=PRELOAD) as z:
        for place in ("forward", "backward"):
            case = Case(place, rank=world - 1)
            t0 = time.perf_counter()
            outs = z.run(fault_mode_loop, case, "lives", "ulysses", timeout=120, pg_timeout=60, strict=False)
            job = time.perf_counter() - t0
            problems = mode_problems(case, "lives", outs)
            if problems:
                raise RuntimeError(f"{place}, rank lives on, P={world}: {problems}")
            out[f"{place}, rank lives on"] = (latency(case, outs), job)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq", type=str, default="1024,8192", help="comma-separated sequence lengths")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--latency-nproc", type=str, default="2,3,4")
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args()
    seqs = [int(x) for x in args.seq.split(",")]
    res = run_distributed(_work, args.nproc, seqs, args.heads, args.dim, args.layers, args.repeats, timeout=1800)[0]
    print(f"{args.layers} layers, forward + backward; ms per step (slowest rank, median), ratio on / off")
    print(f"{'P':>2} {'S':>6} {'strategy':<8} " + " ".join(f"{n:>12}" for n in VARIANTS) + "   on/off")
    for (s, strategy), t in res.items():
        print(f"{args.nproc:>2} {s:>6} {strategy:<8} " + " ".join(f"{t[n] * 1e3:12.2f}" for n in VARIANTS)
              + f"  {t['channel on'] / t['channel off']:7.3f}")
    if args.skip_latency:
        return
    from seqpar.testing.user_loop import USER_PLACES

    print("\none rank fails at step 1 of a user loop: seconds from the fault to every rank raised (job total);")
    print("the exception ends the failing process, or it catches it and lives on (waits until the others raised)")
    for world in (int(x) for x in args.latency_nproc.split(",")):
        lat = {**_latency(world, USER_PLACES), **_lives_on(world)}
        print(f"P={world}: " + ", ".join(f"{p} {a:.2f} ({j:.1f})" for p, (a, j) in lat.items()))


if __name__ == "__main__":
    main()
