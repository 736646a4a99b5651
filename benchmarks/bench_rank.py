"""One rank of a P-rank sequence-parallel job, on one device (issue 27): its real work, timed.

The GPU machines here have one GPU, so a P-rank job cannot run; what can be measured is each rank's
compute on the real device, with its communication counted in bytes. This runs rank ``r``'s real
code path in this one process as rank ``r`` of ``P`` on torch's fake process group
(:func:`seqpar.compat.fake_process_group`): every collective returns at once and moves no bytes
(the all-to-alls, the ring's K/V hops), everything else is what that rank runs -- the strategy's
local copies, kernels, merges, the model's layers. Values that would have arrived are whatever the
receive buffers held, which changes no shape and no amount of work (a ring block's plan comes from
the positions, not the data).

Three things per (strategy, P, S), forward + backward, batch 1, causal, zigzag for rings:

* ``attention``  ``seqpar.sp_attention`` on the rank's ``[1, S/P, H, D]`` q, k, v;
* ``layer``      one decoder layer of a Llama-shaped model: (time with ``L + 1`` layers - time with
                 ``L``), each a full training step of ``seqpar.parallelize``-d model;
* ``step``       a full step (forward, loss, backward) of the model with ``--layers`` layers.

Printed per row: milliseconds (the fastest of ``--repeats``), achieved TFLOP/s and MFU against this
device's measured matmul rate (``--dtype``), peak memory (CUDA; a layer row holds both its models),
and the bytes the rank would move per layer, forward (the planner's count:
:func:`seqpar.planner.cost.estimate`). A layer is a difference of two timings: on a small CPU model
it is within the noise (of either sign); on a GPU at 8B shapes it is most of a step. FLOPs per
rank are the model FLOPs of :func:`flops` (matmuls, 2 per multiply-add, backward twice the
forward; causal attention half the square), divided by P -- what peers quote as MFU.

    python benchmarks/bench_rank.py        # CUDA: Llama-3-8B shapes, bf16 (see --help for sizes)
    python benchmarks/bench_rank.py --device cpu --dtype float32 --shape tiny --seq 256 --p 2,4   # a dry run
    python benchmarks/bench_rank.py --device cpu --dtype float32 --shape small-llama3 --what layer \
        --strategies ring --p 4 --seq 4096 --compile aot_eager          # compiled vs eager on the CPU
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped decoder: heads, KV heads, head dim, hidden, MLP, vocabulary."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096
    inter: int = 14336
    vocab: int = 128256


LLAMA3_8B = Shape()
SMALL_LLAMA3 = Shape(heads=8, kv_heads=2, head_dim=32, hidden=256, inter=896, vocab=8192)  # seqpar's small-llama3
TINY = Shape(heads=4, kv_heads=2, head_dim=8, hidden=32, inter=64, vocab=128)
SHAPES = {"llama3-8b": LLAMA3_8B, "small-llama3": SMALL_LLAMA3, "tiny": TINY}


def layer_params(s: Shape) -> int:
    """Matmul weights of one decoder layer: q, k, v, o projections and the gated MLP."""
    return s.hidden * s.head_dim * (2 * s.heads + 2 * s.kv_heads) + 3 * s.hidden * s.inter


def attention_flops(s: Shape, seq: int, p: int) -> float:
    """One rank's causal attention, forward + backward: ``QK^T`` and ``PV`` are 4 S^2 D per head,
    half of it visible, the backward 2.5x the forward (five matmuls to two)."""
    return 3.5 * 2 * seq * seq * s.heads * s.head_dim / p


def flops(what: str, s: Shape, seq: int, p: int, layers: int = 1) -> float:
    """One rank's model FLOPs (forward + backward) of ``what``: ``"attention"``, ``"layer"`` (its
    matmuls: 6 per weight per token, plus attention) or ``"step"`` (``layers`` layers and the
    output head; the embedding is a lookup)."""
    tokens = seq / p
    layer = 6 * layer_params(s) * tokens + attention_flops(s, seq, p)
    return {"attention": attention_flops(s, seq, p), "layer": layer,
            "step": layers * layer + 6 * s.hidden * s.vocab * tokens}[what]


def split(strategy: str, p: int, heads: int) -> tuple[int, int]:
    """``(ulysses, ring)`` of a strategy at P ranks: hybrid puts 2 ranks on ulysses (P >= 4)."""
    if strategy == "ulysses":
        return p, 1
    if strategy == "ring":
        return 1, p
    u = 2 if p >= 4 and heads % 2 == 0 else 1
    return u, p // u


def bytes_per_layer(s: Shape, seq: int, p: int, strategy: str, dtype_bytes: int) -> int:
    """Bytes this rank sends per layer, forward, from the planner (all-to-all plus ring hops)."""
    from seqpar.planner.cost import estimate

    u, r = split(strategy, p, s.heads)
    c = estimate(1, u, r, heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, hidden_size=s.hidden,
                 devices_per_node=8, seq_len=seq, layers=1, dtype_bytes=dtype_bytes, batch=1,
                 intermediate_size=s.inter, causal=True, checkpointing=False)
    return c.comm_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fns: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """Each ``fns[name]()``'s fastest time in seconds after one warm-up, the functions run in turn
    within each repeat (a loaded machine slows them alike; the minimum drops what others added)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: min(ts) for name, ts in times.items()}


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """This device's measured FLOP/s of an ``n x n`` matmul in ``dtype`` (the MFU denominator)."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n ** 3 / _timed({"matmul": lambda: a @ b}, device, 5)["matmul"]


def _mesh(strategy: str, p: int, heads: int, device: torch.device):
    from seqpar.comm.mesh import init_mesh

    u, r = split(strategy, p, heads)
    if strategy == "hybrid":
        return init_mesh(sp=p, ulysses=u, ring=r, device_type=device.type)
    return init_mesh(sp=p, device_type=device.type)


def _attention_step(s: Shape, seq: int, p: int, strategy: str, dtype: torch.dtype, device: torch.device):
    from seqpar.attention.dispatch import sp_attention
    from seqpar.attention.layout import layout_permutation
    from seqpar.attention.shard import SeqShard

    mesh = _mesh(strategy, p, s.heads, device)
    n = seq // p
    q, k, v = (torch.randn(1, n, h, s.head_dim, device=device, dtype=dtype, requires_grad=True)
               for h in (s.heads, s.kv_heads, s.kv_heads))  # [B, S/P, H, D]
    layout = "contiguous" if strategy == "ulysses" else "zigzag"
    perm = None if layout == "contiguous" else layout_permutation(seq, p, layout).to(device)
    shard = SeqShard((n,) * p, perm)

    def step() -> None:
        out = sp_attention(q, k, v, mesh=mesh, strategy=strategy, causal=True, shard=shard, validate=False)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None
    return step


def _model_step(s: Shape, seq: int, p: int, strategy: str, dtype: torch.dtype, device: torch.device, layers: int,
                compile_backend: str | None = None):
    import seqpar
    from seqpar.integrations.models import build_model

    mesh = _mesh(strategy, p, s.heads, device)
    with torch.device(device):
        model, _ = build_model("tiny-llama", dtype=dtype, vocab_size=s.vocab, hidden_size=s.hidden,
                               intermediate_size=s.inter, num_hidden_layers=layers, num_attention_heads=s.heads,
                               num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                               max_position_embeddings=max(seq, 1024))
    seqpar.parallelize(model, mesh, strategy=strategy)
    if compile_backend is not None:  # each decoder layer, as torchtitan compiles (no graph break inside)
        for layer in model.model.layers:
            layer.compile(backend=compile_backend)
    ids = torch.randint(0, s.vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    layout = "contiguous" if strategy == "ulysses" else "zigzag"

    def step() -> None:
        local = seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh, layout=layout, device=device)
        model(**local).loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def run_rank(what: str, s: Shape, seq: int, p: int, strategy: str, dtype: torch.dtype, device: torch.device,
             *, rank: int = 0, layers: int = 2, repeats: int = 3, compile_backend: str | None = None
             ) -> dict[str, float]:
    """Rank ``rank``'s ``what`` (see the module doc): ``{"seconds", "flops", "peak_gib"}``; with
    ``compile_backend`` the model's decoder layers compiled (``torch.compile`` backend name)."""
    from seqpar import compat

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with compat.fake_process_group(rank, p):
        if compile_backend is not None:
            torch.compiler.reset()  # each model parallelizes afresh: its layers' graphs are its own
        if what == "attention":
            steps = {"it": _attention_step(s, seq, p, strategy, dtype, device)}
        elif what == "step":
            steps = {"it": _model_step(s, seq, p, strategy, dtype, device, layers, compile_backend)}
        else:  # one layer: two models one layer apart, timed in turn (embedding, head and loss cancel)
            steps = {"it": _model_step(s, seq, p, strategy, dtype, device, layers + 1, compile_backend),
                     "less": _model_step(s, seq, p, strategy, dtype, device, layers, compile_backend)}
        times = _timed(steps, device, repeats)
    seconds = times["it"] - times.get("less", 0.0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"seconds": seconds, "flops": flops(what, s, seq, p, layers), "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--what", default="attention,layer,step")
    parser.add_argument("--strategies", default="ulysses,ring,hybrid")
    parser.add_argument("--p", default="2,4,8", help="comma-separated ranks")
    parser.add_argument("--seq", default="32768,131072", help="comma-separated whole-sequence lengths")
    parser.add_argument("--max-tokens", type=int, default=1 << 30,
                        help="skip model rows (layer, step) whose per-rank tokens pass this")
    parser.add_argument("--layers", type=int, default=2, help="layers of the step's model")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES),
                        help="the model's shape (small-llama3, tiny: CPU runs)")
    parser.add_argument("--matmul", type=int, default=8192, help="matmul size of the measured peak rate")
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="also each model row with its decoder layers compiled (inductor, aot_eager): "
                             "a row '<what>+c' and the ratio compiled / eager")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    s = SHAPES[args.shape]
    rate = matmul_rate(device, dtype, args.matmul)
    print(f"one rank ({args.rank}) of P on {device}, {args.dtype}: {s}; measured matmul {rate / 1e12:.1f} TFLOP/s")
    print(f"{'what':>9} {'strategy':>8} {'P':>2} {'S':>8} {'ms':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8} "
          f"{'MB/layer':>9}  compiled/eager")
    for what in args.what.split(","):
        for strategy in args.strategies.split(","):
            for p in (int(x) for x in args.p.split(",")):
                for seq in (int(x) for x in args.seq.split(",")):
                    if what != "attention" and seq // p > args.max_tokens:
                        continue
                    mb = bytes_per_layer(s, seq, p, strategy, torch.finfo(dtype).bits // 8) / 2**20
                    backends = [None] + ([args.compile] if args.compile and what != "attention" else [])
                    eager = None
                    for backend in backends:
                        m = run_rank(what, s, seq, p, strategy, dtype, device, rank=args.rank, layers=args.layers,
                                     repeats=args.repeats, compile_backend=backend)
                        eager = m["seconds"] if backend is None else eager
                        achieved = m["flops"] / m["seconds"]
                        name, ratio = (what, "") if backend is None else (f"{what}+c", f"{m['seconds'] / eager:.2f}")
                        print(f"{name:>9} {strategy:>8} {p:>2} {seq:>8} {1e3 * m['seconds']:>10.2f} "
                              f"{achieved / 1e12:>8.2f} {achieved / rate:>6.1%} {m['peak_gib']:>8.2f} {mb:>9.1f}  "
                              f"{ratio}", flush=True)


if __name__ == "__main__":
    main()
