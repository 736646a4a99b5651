"""seqpar against diffusers' own context parallelism on the same diffusers transformer, in one run.

    python benchmarks/bench_dit.py                  # Flux-shaped, P = 2, 4096 image + 128 text tokens
    python benchmarks/bench_dit.py --p 2 --image 4096 --repeats 5

The same model (a FluxTransformer2DModel: double- and single-stream MMDiT blocks, joint attention over
text and image) and the same inputs go through

* seqpar: ``seqpar.parallelize(model, mesh, strategy="ulysses")``, the drop-in call (whole output on
  every rank) and the sharded one (each rank's tokens, the loss per shard), gradients averaged by
  ``seqpar.sync_gradients``;
* diffusers: ``model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P))`` -- its
  Ulysses over the model's ``_cp_plan`` (its accelerator check patched for CPU ranks, here only:
  ``torch.accelerator.device_count`` answers 1 so a CPU rank is device 0). Its gather's backward keeps
  each rank's slice, so its gradients are *summed* over the ranks to be the model's.

On a GPU (``torch.cuda.is_available()``) the ring of both is added (diffusers' needs an attention
backend that returns the log-sum-exp: ``_native_cudnn`` / flash). Printed, per variant: exactness
against the unsharded model in float64 (loss, largest gradient difference; a small shape), then at
the timed shape (float32) a training step's time (forward, flow-matching loss, backward, gradient
sync; the median over repeats of the slowest rank, variants interleaved) and each rank's peak of live
tensor memory (:class:`seqpar.testing.memory.LiveMemory`, the largest rank), and both as ratios to
diffusers' Ulysses. Shapes where both run: token counts and heads divisible by P (diffusers' Ulysses
needs it; seqpar does not).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import seqpar
from seqpar.comm.launch import run_distributed
from seqpar.integrations.diffusers import flow_matching_loss, shard_output
from seqpar.testing.float64_casts import Float64Casts
from seqpar.testing.memory import MIB, LiveMemory

SEQPAR, SEQPAR_SHARDED, DIFFUSERS = "seqpar ulysses", "seqpar ulysses (sharded out)", "diffusers ulysses"
SEQPAR_RING, DIFFUSERS_RING = "seqpar ring", "diffusers ring"


@contextlib.contextmanager
def cpu_ranks_as_devices() -> Iterator[None]:
    """diffusers' enable_parallelism divides by ``torch.accelerator.device_count()`` (0 on a CPU):
    answer 1 inside the block, so every CPU rank is device 0. The bench's own patch, undone on exit."""
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: max(real(), 1)
    try:
        yield
    finally:
        torch.accelerator.device_count = real


def build(args: argparse.Namespace, dtype: torch.dtype, image: int, text: int, seed: int = 0) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=args.layers, num_single_layers=args.layers,
                                   attention_head_dim=args.dim, num_attention_heads=args.heads,
                                   joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=_axes(args.dim))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every weight drawn (diffusers zero-inits the gates: attention would not count)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.5))
    return model.to(dtype).train()


def _axes(dim: int) -> tuple[int, int, int]:
    """Flux's RoPE axes (frame, height, width) for a head dim: even sizes summing to it."""
    w = (dim * 3 // 8) // 2 * 2
    return (dim - 2 * w, w, w)


def inputs(image: int, text: int, dtype: torch.dtype, batch: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    side = int(image ** 0.5)
    ids = torch.stack([torch.zeros(image), torch.arange(image) // side, torch.arange(image) % side], -1)
    return dict(hidden_states=torch.randn(batch, image, 16, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 64, generator=g).to(dtype),
                pooled_projections=torch.randn(batch, 32, generator=g).to(dtype),
                img_ids=ids.to(dtype), txt_ids=torch.zeros(text, 3, dtype=dtype),
                timestep=torch.full((batch,), 0.5, dtype=dtype))


def _target(like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(like.shape, generator=g).to(like.dtype)


class Variant:
    """One way to run a training step on this rank: its model and how its gradients are reduced."""

    def __init__(self, name: str, model: torch.nn.Module, mesh: Any, sharded: bool, summed: bool) -> None:
        self.name, self.model, self.mesh, self.sharded, self.summed = name, model, mesh, sharded, summed

    def step(self, batch: dict[str, Any], target: torch.Tensor) -> float:
        self.model.zero_grad(set_to_none=True)
        out = self.model(**batch, return_dict=False)[0]  # diffusers' CP hooks take no output dataclass
        if self.sharded:
            loss = flow_matching_loss(out, shard_output(self.model, target), mesh=self.mesh)
        else:
            loss = flow_matching_loss(out, target)
        loss.backward()
        if self.summed:  # diffusers: each rank holds its own tokens' share of every gradient
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        else:
            seqpar.sync_gradients(self.model, self.mesh)
        return float(loss.detach())


def variants(base: torch.nn.Module, mesh: Any, p: int, ring: bool) -> list[Variant]:
    from diffusers import ContextParallelConfig

    out = [Variant(SEQPAR, seqpar.parallelize(copy.deepcopy(base), mesh), mesh, False, False),
           Variant(SEQPAR_SHARDED, seqpar.parallelize(copy.deepcopy(base), mesh, output="sharded"), mesh, True, False)]
    with cpu_ranks_as_devices():
        theirs = copy.deepcopy(base)
        theirs.enable_parallelism(config=ContextParallelConfig(ulysses_degree=p))
    out.append(Variant(DIFFUSERS, theirs, mesh, False, True))
    if ring:
        out.append(Variant(SEQPAR_RING, seqpar.parallelize(copy.deepcopy(base), mesh, strategy="ring"), mesh, False,
                           False))
        theirs = copy.deepcopy(base)
        theirs.set_attention_backend("_native_cudnn")
        theirs.enable_parallelism(config=ContextParallelConfig(ring_degree=p))
        out.append(Variant(DIFFUSERS_RING, theirs, mesh, False, True))
    return out


def exactness(args: argparse.Namespace, mesh: Any, p: int, device: torch.device) -> dict[str, tuple[float, float]]:
    """Each variant's (loss difference, largest gradient difference) against the unsharded model, float64."""
    base = build(args, torch.float64, args.check_image, args.check_text).to(device)
    batch = {k: v.to(device) for k, v in inputs(args.check_image, args.check_text, torch.float64).items()}
    ref = copy.deepcopy(base)
    with Float64Casts():
        out = ref(**batch).sample
        target = _target(out)
        loss_ref = float(flow_matching_loss(out, target))
        flow_matching_loss(out, target).backward()
    grads = [q.grad for q in ref.parameters()]
    res = {}
    for v in variants(base, mesh, p, args.ring):
        with Float64Casts():
            loss = v.step(batch, target)
        worst = max(float((q.grad - g).abs().max()) for q, g in zip(v.model.parameters(), grads, strict=True))
        res[v.name] = (abs(loss - loss_ref), worst)
    return res


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """``(wall seconds of the slowest rank, CPU seconds of every rank together)`` of one call."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    took = torch.tensor([time.perf_counter() - start, time.process_time() - cpu], dtype=torch.float64)
    wall = took[:1].clone()
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slowest rank's
    dist.all_reduce(took)
    return float(wall), float(took[1])


def worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(max(1, args.threads))
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = seqpar.init_mesh(sp=world, device_type=device.type)
    exact = exactness(args, mesh, world, device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    base = build(args, dtype, args.image, args.text).to(device)
    batch = {k: v.to(device) for k, v in inputs(args.image, args.text, dtype).items()}
    target = _target(torch.empty(1, args.image, 16, dtype=dtype)).to(device)
    runs = variants(base, mesh, world, args.ring)
    times: dict[str, list[tuple[float, float]]] = {v.name: [] for v in runs}
    for v in runs:  # warm-up
        v.step(batch, target)
    for r in range(args.repeats):
        for v in runs[r % len(runs):] + runs[:r % len(runs)]:  # the order rotates each repeat
            times[v.name].append(timed(lambda v=v: v.step(batch, target)))
    peaks = {}
    for v in runs:
        with LiveMemory() as mem:
            v.step(batch, target)
        peak = torch.tensor([float(mem.peak_bytes)])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peaks[v.name] = float(peak) / MIB
    return {"exact": exact, "time": {k: statistics.median(w for w, _ in t) for k, t in times.items()},
            "cpu": {k: statistics.median(c for _, c in t) for k, t in times.items()}, "peak": peaks}


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"Flux-shaped MMDiT, {args.layers} double + {args.layers} single blocks, {args.heads} heads x {args.dim}, "
          f"P={args.p}; exactness at {args.check_image} + {args.check_text} tokens (float64), timing at "
          f"{args.image} image + {args.text} text tokens, {args.repeats} repeats")
    base_t, base_c, base_m = res["time"][DIFFUSERS], res["cpu"][DIFFUSERS], res["peak"][DIFFUSERS]
    print(f"{'variant':30s} {'loss diff':>9s} {'grad diff':>9s} {'step s':>7s} {'ratio':>6s} {'CPU s':>7s} "
          f"{'ratio':>6s} {'peak MiB':>8s} {'ratio':>6s}")
    for name, t in res["time"].items():
        loss, grad = res["exact"][name]
        c, m = res["cpu"][name], res["peak"][name]
        print(f"{name:30s} {loss:9.1e} {grad:9.1e} {t:7.3f} {t / base_t:6.3f} {c:7.3f} {c / base_c:6.3f} "
              f"{m:8.1f} {m / base_m:6.3f}")
    print("ratio: to diffusers' Ulysses (step: the slowest rank's wall time; CPU: every rank's process time, "
          "gloo's threads included -- the work done, which other jobs on the machine disturb less)")


def text_stream_cost(args: argparse.Namespace) -> None:
    """Shard the text stream or replicate it? One Flux double-stream block's forward + backward on one
    rank, CPU seconds: with the text sharded (``T/P`` text tokens per rank, as seqpar runs it) and
    replicated (all ``T`` on every rank; the attention then also needs the text outputs gathered over
    heads, as many bytes as the text's share of the all-to-all that sharding sends). The image tokens
    are ``N/P`` per rank either way; attention is local here, so this is the compute alone."""
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    dim = args.heads * args.dim
    torch.manual_seed(0)
    block = FluxTransformerBlock(dim=dim, num_attention_heads=args.heads, attention_head_dim=args.dim)

    def cpu_seconds(n_img: int, n_txt: int) -> float:
        took = []
        for _ in range(args.repeats):
            h, e = torch.randn(1, n_img, dim, requires_grad=True), torch.randn(1, n_txt, dim, requires_grad=True)
            start = time.process_time()
            eo, ho = block(hidden_states=h, encoder_hidden_states=e, temb=torch.randn(1, dim))
            (eo.sum() + ho.sum()).backward()
            took.append(time.process_time() - start)
        return statistics.median(took)

    torch.set_num_threads(1)
    sharded, replicated = (cpu_seconds(args.image // args.p, t) for t in (args.text // args.p, args.text))
    print(f"text stream, one double block per rank ({args.image // args.p} image tokens): sharded {sharded:.3f} s, "
          f"replicated {replicated:.3f} s = {replicated / sharded:.3f}x (seqpar shards it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--p", type=int, default=2)
    parser.add_argument("--image", type=int, default=4096, help="image tokens (a square; divisible by P)")
    parser.add_argument("--text", type=int, default=128, help="text tokens (divisible by P)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=32, help="head dim")
    parser.add_argument("--layers", type=int, default=2, help="double-stream blocks, and as many single-stream")
    parser.add_argument("--check-image", type=int, default=64)
    parser.add_argument("--check-text", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    args.ring = torch.cuda.is_available()
    if args.image % args.p or args.text % args.p or args.heads % args.p:
        parser.error("diffusers' Ulysses needs image tokens, text tokens and heads divisible by P")
    report(run_distributed(worker, args.p, args, timeout=3600)[0], args)
    text_stream_cost(args)


if __name__ == "__main__":
    main()
