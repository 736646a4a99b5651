"""Which run mode a handled token mixer takes: the first of its family's modes that fits, except
where both ``"state"`` and ``"heads"`` fit -- then the one with the smaller estimated time per
rank, from two measured machine constants. Pure arithmetic, the same on every rank (it reads the
batch's shape, the mesh size and the module's dimensions, never a clock).

Per layer and rank, forward and backward, both modes compute the layer's projections, gates and
norms for ``S/P`` tokens' worth and the scan for ``S/P`` tokens' worth; what differs is::

    heads   moves the layer's input and output, 4 (P-1)/P B S D b bytes (all-gather and
            reduce-scatter, each way), and holds the input whole
    state   computes the scan's extra work (:mod:`.state_scans`: ``e`` flops per token, forward and
            backward: the family's ``state_extra_flops``) and moves a few matrices per piece

so with ``F`` the scan kernels' flop rate and ``W`` the bandwidth of an all-gather of the sp group::

    state  iff  B (S/P) e / F  <=  4 (P-1)/P B S D b / W     <=>     e W  <=  4 (P-1) D b F

independent of S (both grow linearly; state's memory stays O(S/P) either way, heads' O(S)). At
P = 1 heads (the module whole, no communication) is cheaper; the benchmark
(``benchmarks/bench_mixers.py``) prints the predicted and the measured times of both.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from ...batch.sharding import LocalBatch
from .registry import HEADS, STATE, MixerFamily, mode_named


@dataclass(frozen=True)
class Machine:
    """``flops``: the scan kernels' effective rate per rank (flop/s); ``bandwidth``: bytes per
    second a rank moves in the sp group's all-gather / reduce-scatter; ``source``: where from."""

    flops: float
    bandwidth: float
    source: str


MACHINES = {
    "cpu": Machine(2.0e9, 4.0e8, "measured: benchmarks/bench_mixers.py --calibrate, 2 CPU cores, gloo, 2026-12-02"),
    "cuda": Machine(5.0e13, 1.5e11, "assumed (H100 / H200 class with NVLink), not measured"),
}


@dataclass(frozen=True)
class Choice:
    """The mode a call runs in, and why (for :func:`seqpar.integrations.mixers.describe_token_mixers`)."""

    mode: str
    reason: str


def choose(family: MixerFamily, module: nn.Module, x: Tensor, batch: LocalBatch) -> Choice:
    """The run mode of ``module`` on this call (see the module doc)."""
    fitting = [m for m in family.modes if mode_named(m).fits(family, module, batch)]
    if not (STATE in fitting and HEADS in fitting):
        return Choice(fitting[0], "the first of its modes that fits")
    state_s, heads_s = estimate(family, module, x, batch)
    mode = STATE if state_s <= heads_s else HEADS
    return Choice(mode, f"estimated {state_s * 1e3:.3g} ms (state) vs {heads_s * 1e3:.3g} ms (heads) per rank beyond "
                        f"their common work, S={sum(batch.shard.seq_lens)}, P={batch.sp_size}")


def estimate(family: MixerFamily, module: nn.Module, x: Tensor, batch: LocalBatch) -> tuple[float, float]:
    """``(state, heads)``: the seconds each mode spends beyond their common work, on this rank."""
    machine = MACHINES["cuda" if x.device.type == "cuda" else "cpu"]
    p, s, rows = batch.sp_size, sum(batch.shard.seq_lens), x.shape[0]
    state = rows * s / p * family.state_extra_flops(module) / machine.flops
    heads = 4 * (p - 1) / p * rows * s * x.shape[-1] * x.element_size() / machine.bandwidth
    return state, heads


def gated_delta_extra(heads: int, k: int, chunk: int = 64) -> float:
    """Flops per token, forward and backward (3x forward), of a delta rule's ``K`` extra value
    columns: their triangular solve and intra-chunk product (``3 c K``) and three state products
    (``6 K^2``) per head."""
    return 3.0 * heads * (3 * chunk * k + 6 * k * k)


def mamba2_extra(heads: int, head_dim: int, state: int, chunk: int) -> float:
    """Flops per token, forward and backward, of Mamba2's second scan: per head ``2 c (N + P)``
    (the chunk's C B^T and its product with x) and ``4 P N`` (states in and out)."""
    return 3.0 * heads * (2 * chunk * (state + head_dim) + 4 * head_dim * state)


def mamba_extra(channels: int, state: int) -> float:
    """Flops per token, forward and backward (recomputed), of Mamba's carried term: ``4 N`` per
    channel forward, twice that backward, once more recomputed."""
    return 16.0 * channels * state
