"""The dynamic schedule's cost model refitted on this machine, from the model's own bins.

    machine = measure_machine(model, mesh, shapes, token_budget=2048)     # collective: every rank
    cost = functools.partial(bin_seconds, shapes=shapes, machine=machine)
    dyn = DynamicSP(mesh, token_budget=2048, cost=cost)

Probes, each a forward + backward of random tokens run on every rank at once (every block of a
degree runs the same bin, so every rank runs the same collectives -- FSDP's too), sized by the
per-rank budget ``B``:

    degree 1    [B/8] x 2, [B/2] x 2, [B/4] x 4, [B/8] x 8,     -> fit_machine: the matmul and the
                [B/16] x 16                                      attention rates, a document's
                                                                 and a bin's fixed seconds
    degree k    [k B/8] x 2, [k B/16] x 8, [k B/2] x 2           -> fit_degrees: how much slower a
                                                                 rank computes at k, a layer's
                                                                 fixed seconds
    link        all-to-alls of two sizes over the job's sp group -> bytes/s, a collective's latency

Every probe runs once per round, in turn, for ``rounds`` rounds, after one warm-up round, and
counts with its median (a burst of other load lands on every probe alike); then averaged over the
ranks, so every rank plans with the same model (else the ranks' schedules differ and
:meth:`~seqpar.planner.bins.DynamicSP.plan` raises). The probes' gradients are dropped
(``zero_grad(set_to_none=True)``); the model's weights and RNG streams are untouched.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..batch.sharding import shard_batch
from ..comm import collectives
from ..comm.degrees import degree_meshes
from .work import Machine, Shapes, fit_degrees, fit_machine

MIN_MEASURED_BUDGET = 16
"""The least per-rank budget :func:`measure_machine` takes: its probes hold up to 16 documents a rank."""

Probe = tuple[list[int], int]
"""``(documents' token counts, degree)`` of one probe bin."""


def probe_bins(token_budget: int, degrees: Sequence[int]) -> list[Probe]:
    """The probes for a per-rank ``token_budget`` (see the module doc): sizes the budget holds, and
    an even number of documents each (a preference objective's probe holds whole pairs)."""
    b = token_budget
    probes: list[Probe] = [([b // 8] * 2, 1), ([b // 2] * 2, 1), ([b // 4] * 4, 1), ([b // 8] * 8, 1),
                           ([b // 16] * 16, 1)]
    for k in degrees:
        if k > 1:
            probes += [([k * b // 8] * 2, k), ([k * b // 16] * 8, k), ([k * b // 2] * 2, k)]
    return probes


def _rows(docs: Sequence[int], vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (sum(docs),), generator=generator)
    pos = torch.cat([torch.arange(n) for n in docs])
    return {"input_ids": ids[None], "labels": ids[None].clone(), "position_ids": pos[None]}


def _timed(fn: Callable[[], object], group: Any) -> float:
    """Seconds of ``fn`` on the slowest rank of ``group`` (a barrier on each side)."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - t0


Sample = tuple[list[int], int, float]
"""``(documents' token counts, degree, seconds per rank)`` of one measured bin."""


@dataclass(frozen=True)
class Measured:
    """What :func:`measure` timed: each probe bin's seconds, and the link's bytes/s and latency."""

    samples: list[Sample]
    bytes_per_s: float
    collective_s: float

    def machine(self, shapes: Shapes, more: Sequence[Sample] = ()) -> Machine:
        """The :class:`Machine` fitted to these samples and ``more`` (e.g. a real step's bins)."""
        samples = [*self.samples, *more]
        machine = fit_machine([(d, s) for d, k, s in samples if k == 1], shapes, bytes_per_s=self.bytes_per_s,
                              collective_s=self.collective_s)
        return fit_degrees(samples, shapes, machine) if any(k > 1 for _, k, _ in samples) else machine


def measure_machine(model: Any, mesh: DeviceMesh, shapes: Shapes, *, token_budget: int,
                    loss_of: Callable[[dict[str, Any]], torch.Tensor] | None = None, rounds: int = 3,
                    device: torch.device | str | None = None) -> Machine:
    """The cost model's :class:`~seqpar.planner.work.Machine` refitted from ``model``'s own bins on
    this machine: :func:`measure`, then fitted."""
    return measure(model, mesh, shapes, token_budget=token_budget, loss_of=loss_of, rounds=rounds,
                   device=device).machine(shapes)


def measure(model: Any, mesh: DeviceMesh, shapes: Shapes, *, token_budget: int,
            loss_of: Callable[[dict[str, Any]], torch.Tensor] | None = None, rounds: int = 3,
            device: torch.device | str | None = None) -> Measured:
    """Time the probes (module doc) of ``model`` on this machine (collective over ``mesh``'s ranks:
    every rank calls it; the same result on every rank). ``loss_of(local)``: a probe's loss
    (default ``model(**local).loss``). Raises ValueError for a budget under
    :data:`MIN_MEASURED_BUDGET` tokens (too small to tell a document's cost from a token's)."""
    if token_budget < MIN_MEASURED_BUDGET:
        raise ValueError(f"measuring the cost model needs a budget of >= {MIN_MEASURED_BUDGET} tokens per rank, "
                         f"got {token_budget}")
    meshes = degree_meshes(mesh)
    world = meshes.all_group
    g = torch.Generator().manual_seed(0)
    bins = probe_bins(token_budget, meshes.degrees)
    probes: list[Callable[[], object]] = []
    for docs, k in bins:
        local = shard_batch(_rows(docs, shapes.vocab_size, g), meshes.mesh(k), num_items_in_batch=float(sum(docs)),
                            grad_ranks=meshes.world, device=device)
        probes.append(lambda local=local: (model(**local).loss if loss_of is None else loss_of(local)).backward())
    sp_group = mesh.get_group("sp")
    sp = dist.get_world_size(sp_group)
    link = []
    for n in (token_budget // 4, token_budget):  # one layer's q of n tokens per rank, in float32
        x = torch.randn(max(n * shapes.heads * shapes.head_dim // sp, 1) * sp, device=collectives.comm_device(sp_group))
        out = torch.empty_like(x)
        link.append(x.numel() * 4 * (sp - 1) / sp)  # bytes leaving this rank
        probes.append(lambda x=x, out=out: dist.all_to_all_single(out, x, group=sp_group))
    try:
        for probe in probes:  # warm-up
            probe()
        times = [[_timed(probe, world) for probe in probes] for _ in range(rounds)]
    finally:
        model.zero_grad(set_to_none=True)
    median = torch.tensor([statistics.median(t[i] for t in times) for i in range(len(probes))], dtype=torch.float64)
    median = median.to(collectives.comm_device(world))
    collectives.all_reduce(median, group=world)
    mean = (median.cpu() / meshes.world).tolist()
    (b0, b1), (t0, t1) = link, mean[-2:]
    if sp == 1:
        bandwidth, latency = float("inf"), 0.0
    elif t1 > t0 and b1 > b0:
        bandwidth = (b1 - b0) / (t1 - t0)
        latency = max(t0 - b0 / bandwidth, 0.0)
    else:  # the larger all-to-all was not slower (load noise): charge all of its time to bytes
        bandwidth, latency = b1 / t1, 0.0
    return Measured([(docs, k, s) for (docs, k), s in zip(bins, mean, strict=False)], bandwidth, latency)


def describe_machine(m: Machine) -> str:
    """One line of a :class:`Machine`'s constants, as measured."""
    return (f"matmuls {m.flops_per_s / 1e9:.3g} GFLOP/s, attention {m.attention_rate / 1e9:.3g} GFLOP/s, "
            f"per bin {m.bin_s * 1e3:.3g} ms, per document {m.doc_s * 1e3:.3g} ms"
            + "".join(f", sp={k}: x{s:.2f} + {f * 1e3:.3g} ms per layer"
                      for (k, s), (_, f) in zip(m.compute_scale, m.layer_s, strict=True)))
