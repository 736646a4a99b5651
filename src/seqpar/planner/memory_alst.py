"""The planner's memory model of the peer: one training step of DeepSpeed's ALST (as
:mod:`seqpar.bench.alst` sets it up: Ulysses, TiledMLP, transformers' activation checkpoints,
TiledFusedLogitsLoss over ~1 GiB logit shards) on a Llama-shaped model, bytes per rank. Pure
arithmetic, the notation of :mod:`seqpar.planner.memory` (``T`` local tokens, ``h``, ``I``, ``q``,
``g``, ``V``, ``L``, ``b``, ``n``)::

    states       weights + gradients + AdamW    n*b + n*b + 2*n*4        (the same as seqpar's, unsharded)
    kept         L*T*h*b                        each layer's input, kept for its recompute
    other        4*T*h*b                        embedding out, final norm, the loss's x_grad, a gradient
    loss shards  k = ceil(T*V*4 / 2**30)        ArcticTraining's "about 1GB fp32 logits" per shard
    loss         3*ceil(T/k)*V*4                log_softmax out, nll_loss's gradient, log_softmax's
                                                gradient, all [tile, V] fp32 (measured: 3 at the peak)
    layer        T*(4h + 3q + 2g)*b + 4*T*H     one decoder layer recomputed for its backward (as
                 + U*T*(q + 2g)*b*2/U ...       seqpar's), plus the all-to-all's gathered q/k/v and
                                                their contiguous copies: 2 * S*(q + 2g)/U*b
    mlp          5*min(T, h)*I*b                one TiledMLP shard's intermediates (ceil(T/h) shards)

    loss phase   weights + optimizer + V*h*b + kept + other + loss      (only the head's gradient exists)
    backward     weights + optimizer + gradients + kept + other + layer + mlp
    peak = the larger phase

The loss runs after the last layer and before any other backward (TiledFusedLogitsLoss computes its
gradients inside its forward; the step begins with the gradients set to None), so its shards and a
layer's recompute are never alive together, and in the loss phase only the head has a gradient.
Checked against the measured peak RSS of the bench (``benchmarks/bench_alst.py``) at its measured
points, within 10% (``tests/planner/test_memory_alst.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .memory import ADAM_STATES, parameter_count

LOGIT_SHARD_BYTES = 2**30
LOSS_COPIES = 3  # [tile, V] fp32 at the loss's peak: log_softmax out, nll_loss's gradient, log_softmax's gradient
MLP_COPIES = 5  # as seqpar's: gate, up, act(gate), their product, a gradient in flight
GATHER_COPIES = 2  # the all-to-all's output and its contiguous rearrangement, per gathered q/k/v


@dataclass(frozen=True)
class AlstMemory:
    """Estimated bytes per rank of one ALST training step (see the module doc)."""

    weights: int
    gradients: int
    optimizer: int
    kept: int  # every layer's input, kept for its recompute
    other: int  # outside the layers
    loss: int  # the loss phase: one logits shard's [tile, V] buffers
    layer: int  # the backward phase: one layer's recompute and backward, with one MLP shard
    head_gradient: int  # the only gradient alive in the loss phase

    @property
    def loss_phase(self) -> int:
        return self.weights + self.optimizer + self.head_gradient + self.kept + self.other + self.loss

    @property
    def backward_phase(self) -> int:
        return self.weights + self.optimizer + self.gradients + self.kept + self.other + self.layer

    @property
    def total(self) -> int:
        """Peak bytes: the larger of the loss and the backward phases."""
        return max(self.loss_phase, self.backward_phase)


def logit_shards(tokens: int, vocab: int) -> int:
    """ArcticTraining's number of loss shards: about 1 GiB of fp32 logits each."""
    return max(1, math.ceil(tokens * vocab * 4 / LOGIT_SHARD_BYTES))


def alst_step_memory(*, tokens: int, hidden_size: int, intermediate_size: int, layers: int, heads: int,
                     kv_heads: int, head_dim: int, vocab_size: int, ulysses: int, dtype_bytes: int = 4,
                     tied: bool = False) -> AlstMemory:
    """Bytes per rank of one ALST step with ``tokens`` tokens on this rank, Ulysses over ``ulysses``
    ranks (the kernel sees ``ulysses * tokens`` tokens of ``heads / ulysses`` heads). Raises
    ValueError for a non-positive size."""
    sizes = dict(tokens=tokens, hidden_size=hidden_size, intermediate_size=intermediate_size, layers=layers,
                 heads=heads, kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab_size, ulysses=ulysses,
                 dtype_bytes=dtype_bytes)
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    t, h, i, b, d = tokens, hidden_size, intermediate_size, dtype_bytes, head_dim
    q, g = heads * d, max(kv_heads, ulysses) * d  # KV heads fewer than the ranks are replicated up to them
    n = parameter_count(hidden_size=h, intermediate_size=i, layers=layers, heads=heads, kv_heads=kv_heads,
                        head_dim=d, vocab_size=vocab_size, tied=tied)
    tile = -(-t // logit_shards(t, vocab_size))
    rest = t * (4 * h + 3 * q + 2 * g) * b + 4 * t * heads
    gathered = GATHER_COPIES * t * (q + 2 * g) * b  # S*(q + 2g)/U over the group, this rank's heads
    mlp = MLP_COPIES * min(t, h) * i * b
    return AlstMemory(weights=n * b, gradients=n * b, optimizer=ADAM_STATES * n * 4, kept=layers * t * h * b,
                      other=4 * t * h * b, loss=LOSS_COPIES * tile * vocab_size * 4, layer=rest + gathered + mlp,
                      head_gradient=vocab_size * h * b)
