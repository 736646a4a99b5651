"""Which run mode a handled token mixer takes: the first of its family's modes that fits, except
where both ``"state"`` and ``"heads"`` fit on more than one rank -- then the one measured faster.

The two cost different things: state passing computes the scan's extra work (:mod:`.state_scans`)
on ``S/P`` tokens and moves a few matrices; split by heads moves the layer's input and output
(``O(S D)`` bytes each way) and holds the input whole. Which is faster depends on the kernels (a
scan that loops token by token favours the shorter shard) and on the links, so seqpar measures it:
the first call of a mixer class at a given P and dtype runs one forward and backward of the layer in
each mode on ``CALIBRATION_TOKENS`` random tokens per rank (its own generator, so the caller's random
state is untouched; gradients taken with ``torch.autograd.grad``, so no ``.grad`` changes), twice,
keeps each mode's faster run, takes the slowest rank's time (one all-reduce) and keeps the decision
for the model. Both modes cost time linear in S, so the decision carries over to any length; every
rank makes it from the same numbers. At P = 1 heads runs the layer whole (nothing moved, nothing
added): chosen without measuring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...attention.shard import SeqShard
from ...batch.local_batch import LocalBatch
from ...comm import collectives
from ...comm.collectives import comm_device
from .registry import HEADS, STATE, MixerFamily, mode_named

CALIBRATION_TOKENS = 512
"""Tokens per rank of the measurement (a plain row, contiguous layout)."""


@dataclass(frozen=True)
class Choice:
    """The mode a call runs in, and why (for :func:`seqpar.integrations.mixers.describe_token_mixers`)."""

    mode: str
    reason: str


def choose(family: MixerFamily, module: nn.Module, x: Tensor, batch: LocalBatch, group: dist.ProcessGroup,
           measured: dict[tuple[object, ...], Choice]) -> Choice:
    """The run mode of ``module`` on this call (see the module doc); ``measured`` keeps the
    decisions made by measuring (the caller's, one per model)."""
    fitting = [m for m in family.modes if mode_named(m).fits(family, module, batch)]
    if not (STATE in fitting and HEADS in fitting):
        return Choice(fitting[0], "the first of its modes that fits")
    if batch.sp_size == 1:
        return Choice(HEADS, "one rank: the layer whole, nothing moved")
    key = (type(module).__name__, batch.sp_size, x.dtype, x.device.type)
    if key not in measured:
        seconds = measure(family, module, x, batch, group, (STATE, HEADS))
        mode = min(seconds, key=seconds.__getitem__)
        measured[key] = Choice(mode, "measured " + ", ".join(f"{m} {s * 1e3:.3g} ms" for m, s in seconds.items())
                               + f" (forward + backward, {CALIBRATION_TOKENS} tokens per rank, P={batch.sp_size})")
    return measured[key]


def measure(family: MixerFamily, module: nn.Module, x: Tensor, batch: LocalBatch, group: dist.ProcessGroup,
            modes: tuple[str, ...]) -> dict[str, float]:
    """Seconds of one forward + backward of ``module`` in each of ``modes`` on a plain row of
    :data:`CALIBRATION_TOKENS` tokens per rank -- the faster of two runs, the slowest rank's (every
    rank runs the same collectives). Parameter ``.grad`` and the global random state are untouched."""
    p, t = batch.sp_size, CALIBRATION_TOKENS
    plain = LocalBatch(SeqShard((t,) * p), sp_rank=batch.sp_rank, sp_size=p, dp_size=1, denominator=1.0,
                       num_items_in_batch=None, loss_weights=None)
    gen = torch.Generator(x.device).manual_seed(batch.sp_rank)
    sample = torch.randn(1, t, x.shape[-1], generator=gen, device=x.device, dtype=x.dtype)
    params = [q for q in module.parameters() if q.requires_grad]
    best = {m: float("inf") for m in modes}
    for _ in range(2):
        for mode in modes:
            inp = sample.clone().requires_grad_()
            _sync(x)
            start = time.perf_counter()
            with torch.enable_grad():
                out = mode_named(mode).run(family, module, inp, plain, group)
                torch.autograd.grad(out.float().square().sum(), [inp, *params], allow_unused=True)
            _sync(x)
            best[mode] = min(best[mode], time.perf_counter() - start)
    times = torch.tensor([best[m] for m in modes], dtype=torch.float64, device=comm_device(group))
    collectives.all_reduce(times, op=dist.ReduceOp.MAX, group=group)  # fault-aware, as every seqpar wait
    return dict(zip(modes, times.tolist(), strict=True))


def _sync(x: Tensor) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
