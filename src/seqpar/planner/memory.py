"""The planner's memory model: bytes per rank of one training step of a decoder-only causal LM
(Llama-shaped: RMSNorm, RoPE, gated MLP), sequence-parallel, with or without the memory switches of
:func:`seqpar.reduce_memory`. Pure arithmetic, no communication.

Notation: ``T`` tokens on this rank (the largest shard), ``h`` hidden, ``I`` MLP width, ``q = H*d``
query width, ``g = H_kv*d`` KV width, ``V`` vocabulary, ``L`` layers, ``b`` bytes per element,
``U`` the ulysses degree (the attention kernel sees ``U*T`` tokens of ``q/U`` heads), ``n`` the
parameter count, ``F`` the ranks FSDP shards over (1: replicated)::

    weights = n*b/F     gradients = n*b/F     optimizer = 2*n*4/F    (AdamW: exp_avg, exp_avg_sq)

    per layer, except the MLP        a = T*b*(4h + 3q + 2g) + 4*T*H     norms, rope'd q/k, v, kernel out,
                                           + 2*T*h*4 (b < 4)            o-proj input; the kernel's fp32 lse;
                                                                       each RMSNorm's fp32 copy of its input
    MLP intermediates                m = 5*T*I*b                        gate, up, act, product (kept), a
                                                                       gradient (in flight in the backward)
    logits                           l = 3*T*V*4                        fp32 logits, log-softmax, a gradient
    outside the layers               o = 4*T*h*b + T*h*4 (b < 4)        embedding out, final norm (its fp32
                                                                       copy), gradient

    activations = l + o + L*(a + m)

The coefficients are counts of the tensors transformers' Llama keeps, checked against the live-tensor
probe (:class:`seqpar.testing.memory.LiveMemory`) for hidden, MLP width, KV heads, layers and
vocabulary varied one at a time (within 2%). A narrower dtype (``b < 4``, bfloat16) adds what the
census of its peaks (:class:`seqpar.bench.census.PeakCensus`) finds computed in float32: the
RMSNorm's ``hidden.to(float32)``, kept for its backward (none with ``fused_norm``: Liger's kernel).
Switches (each replaces a term by its tile)::

    tiled_mlp   m -> 5*min(T, mlp_tile)*I*b       (the tile is recomputed in backward; by default
                                                  mlp_tile_for(T, h, I): the tile follows the shard)
    tiled_loss  l -> max(R*V*(b' + 4), R*V*(4 + b') + V*h*(b + 4))    (R = min(T, loss_tile): one tile
                                                  alive, its log-sum-exp, then its gradient: the fp32 logits made
                                                  the softmax gradient in place, b' = b for a narrower model's own
                                                  copy, and there its grad_w product with its fp32 copy, V*h*(b+4);
                                                  under tp the log-sum-exp adds R*V*4 of exponentials)
    checkpoint  L*(a + m) -> L*T*h*b + a + m      (layer inputs kept; one layer rebuilt at a time)
    offload     L*T*h*b leaves the device         (counted in ``offloaded``: host memory)

A dynamic SP schedule under FSDP2 (``gathered``: :meth:`seqpar.planner.bins.StepBins.fsdp`, sharded
with ``reshard_after_forward=False`` and gradient sync held back until the micro-step's flush) keeps
every parameter all-gathered from the first bin's forward to the flush, and its gradient accumulated
unsharded until that flush reduce-scatters it, beside the shards::

    gathered = n*b + n*max(b, 4)    (whole weights, whole gradients; 0 for the static schedule, which
                                     gathers one layer at a time)

The gradients count in float32 when ``b`` is narrower: FSDP2 accumulates unsynced gradients in the
mixed-precision policy's ``reduce_dtype`` (float32 in ``seqpar train --dtype bfloat16``; torch's
``FSDPParam.to_accumulated_grad_if_needed``). Not yet checked against a measured peak.

Tensor parallelism over ``tp`` ranks (:mod:`seqpar.integrations.distributed.tensor_parallel`: the
model's own plan, heads and MLP columns split, the vocabulary-parallel head) divides what it splits
and keeps the residual stream whole (replicated over tp)::

    n -> n_split / tp + n_whole        q/k/v/o, the MLP, embeddings and head split; norms whole
    a -> T*b*(4h + (3q + 2g)/tp) + 4*T*H/tp (+ 2*T*h*4)     m -> 5*T*(I/tp)*b      l -> T*(V/tp)*(b + 4 + 4)

(the vocabulary-parallel loss holds the shard's logits, their float32 copy where ``b < 4``, and one
float32 buffer: their exponentials, then their gradient in place; a loss tile likewise).

An MoE layer (``experts`` > 0: ``experts`` gated MLPs of width ``expert_intermediate`` and a router,
``top_k`` experts per token) holds ``experts / ep`` experts per rank (expert parallelism over ``ep``
ranks of dp x sp) and, on average over a balanced router, the intermediates of ``top_k * T`` tokens::

    n_experts = experts * 3*h*I_e / ep + h*experts (router)     m -> 5*top_k*T*I_e*b + 2*T*experts*4

(the MoE terms are the arithmetic of the layout, not yet checked against a measured peak here).

``total`` = weights + optimizer + gradients + gathered + activations: the steady state of training
(optimizer states exist from the first step on), gradients counted whole at the activation peak:
an upper bound of a step's peak (the gradients appear while activations are freed; 0.81 to 1.01 of
the measured peak at the twelve layouts), kept for the planner's choices until ``phase_peak``
replaces it there. On a CPU rank the offloaded bytes stay
in the same memory, so ``device_peak(on_cpu=True)`` adds them back.

``phase_peak`` is the estimate: the larger of the step's two phases. Checked within 10% of the
measured peak at twelve layouts on 4 gloo ranks (float32 and bfloat16, Ulysses and ring, tp, FSDP2,
with and without the switches: ``tests/planner/test_nd_memory_model.py``, heavy) and of the peak RSS
of the bench's trials with the switches on, beside DeepSpeed's ALST's model
(``tests/planner/test_memory_alst.py``)::

    kept     = L*T*h*b (checkpointed: the inputs on the device) or L*(a + 4/5*m) (none)
    loss     = weights + optimizer + other + kept + l + V*h*max(b, 4) (+ T*h*b tiled: grad_w, grad_h)
    backward = weights + optimizer + other + kept + gradients + (a + m)  (checkpointed: one layer rebuilt)
                                                            or + m/5     (none: the MLP's gradient in flight)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..batch.tiles import DEFAULT_LOSS_TILE, mlp_tile_for
from .bins import SP_SCHEDULES

CHECKPOINT_MODES = ("none", "layers", "offload")
LOGIT_COPIES = 3  # fp32 [T, V] alive at once: logits, log-softmax, a gradient (measured: 3.0)
TILE_COPIES = 1  # [tile, V] at once in the tiled loss: the tile's logits, made the softmax gradient in place (the
# log-sum-exp runs 128 rows at a time, the previous tile is freed first)
MLP_COPIES = 5  # [T, I]: gate, up, act(gate), their product, a gradient in flight (measured: 4.9)
MLP_SAVED = 4  # of them, kept from the forward to the backward (measured at the loss's peak: 4.0)
ADAM_STATES = 2


@dataclass(frozen=True)
class MemorySwitches:
    """Which of :func:`seqpar.reduce_memory`'s switches are on (a plain description, for the planner
    and for ``seqpar bench``). Tiles are in tokens; ``None`` means the library's default."""

    tiled_loss: bool = False
    tiled_mlp: bool = False
    checkpoint: str = "none"
    loss_tile: int | None = None
    mlp_tile: int | None = None

    def __post_init__(self) -> None:
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint={self.checkpoint!r}: choose one of {', '.join(CHECKPOINT_MODES)}")
        for name in ("loss_tile", "mlp_tile"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive number of tokens, got {v!r}")

    @property
    def any(self) -> bool:
        return self.tiled_loss or self.tiled_mlp or self.checkpoint != "none"

    @property
    def label(self) -> str:
        """``"off"`` or e.g. ``"loss+mlp+offload"``."""
        parts = [n for n, on in (("loss", self.tiled_loss), ("mlp", self.tiled_mlp)) if on]
        if self.checkpoint != "none":
            parts.append(self.checkpoint)
        return "+".join(parts) or "off"

    def kwargs(self) -> dict[str, object]:
        """Keyword arguments for ``seqpar.reduce_memory`` (tiles only where given)."""
        kw: dict[str, object] = dict(tiled_loss=self.tiled_loss, tiled_mlp=self.tiled_mlp, checkpoint=self.checkpoint)
        kw.update({k: v for k, v in (("loss_tile", self.loss_tile), ("mlp_tile", self.mlp_tile)) if v is not None})
        return kw


SWITCHES_OFF = MemorySwitches()
SWITCHES_ON = MemorySwitches(tiled_loss=True, tiled_mlp=True, checkpoint="layers")


@dataclass(frozen=True)
class StepMemory:
    """Estimated bytes per rank of one training step (see the module doc for the formulas)."""

    weights: int
    gradients: int
    optimizer: int
    logits: int  # fp32 logits and their gradient (one tile of them with tiled_loss)
    mlp: int  # MLP intermediates alive at once (every layer's; one layer's or one tile's with the switches)
    layers: int  # the rest the decoder layers keep for the backward (checkpointed: their inputs)
    other: int  # outside the layers: embedding output, final norm, the gradient flowing back
    offloaded: int  # saved layer inputs moved to host memory (checkpoint="offload")
    gathered: int = 0  # a dynamic schedule under FSDP2: whole weights and gradients held for the step
    kept: int = 0  # activations alive from the forward to the loss (checkpointed: the inputs left on the device)
    recompute: int = 0  # the backward's own: one checkpointed layer rebuilt, with its MLP tile (none: an MLP gradient)
    head_gradient: int = 0  # the gradients the loss makes before the backward: the head's weight, the hidden states'

    @property
    def activations(self) -> int:
        return self.logits + self.mlp + self.layers + self.other

    @property
    def total(self) -> int:
        """Peak device bytes: weights, optimizer states, gradients and activations together."""
        return self.weights + self.optimizer + self.gradients + self.gathered + self.activations

    def device_peak(self, on_cpu: bool = False) -> int:
        """:attr:`total`, plus the offloaded bytes where host and device memory are the same (CPU)."""
        return self.total + (self.offloaded if on_cpu else 0)

    def phase_peak(self, on_cpu: bool = False) -> int:
        """The estimate of a step's peak (module doc): the larger of its two phases, not everything
        at once (:attr:`total`, an upper bound): the loss (the kept activations, the logits or their
        tile, the gradients the loss makes; the parameters' gradients do not exist yet) and the
        backward (the kept activations, every gradient, one recomputed layer or, without checkpoints,
        an MLP gradient in flight). Plus the offloaded bytes on a CPU."""
        fixed = self.weights + self.optimizer + self.gathered + self.other + self.kept + (self.offloaded if on_cpu
                                                                                           else 0)
        return fixed + max(self.head_gradient + self.logits, self.gradients + self.recompute)


def parameter_count(*, hidden_size: int, intermediate_size: int, layers: int, heads: int, kv_heads: int,
                    head_dim: int, vocab_size: int, tied: bool = False) -> int:
    """Parameters of a Llama-shaped causal LM (no biases): embeddings, lm_head unless tied, per layer
    q/k/v/o projections, the gated MLP and two RMSNorms, and the final norm."""
    return sum(parameter_parts(hidden_size=hidden_size, intermediate_size=intermediate_size, layers=layers,
                               heads=heads, kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab_size, tied=tied))


def parameter_parts(*, hidden_size: int, intermediate_size: int, layers: int, heads: int, kv_heads: int,
                    head_dim: int, vocab_size: int, tied: bool = False, experts: int = 0,
                    expert_intermediate: int | None = None) -> tuple[int, int, int]:
    """``(split by tp, whole on every tp rank, experts)`` parameters of a Llama-shaped causal LM:
    tensor parallelism splits the projections, the dense MLP, the embeddings and the head; the norms
    stay whole; an MoE model (``experts`` > 0) has experts (split by ep) and a router (whole) in
    place of the dense MLP."""
    h, q, g = hidden_size, heads * head_dim, kv_heads * head_dim
    mlp = 3 * h * intermediate_size if not experts else 0
    split = vocab_size * h * (1 if tied else 2) + layers * (h * q + 2 * h * g + q * h + mlp)
    whole = layers * (2 * h + (h * experts if experts else 0)) + h
    expert = layers * experts * 3 * h * (expert_intermediate or intermediate_size) if experts else 0
    return split, whole, expert


def step_memory(*, tokens: int, hidden_size: int, intermediate_size: int, layers: int, heads: int, kv_heads: int,
                head_dim: int, vocab_size: int, dtype_bytes: int = 4, tied: bool = False,
                fsdp_shards: int = 1, switches: MemorySwitches = SWITCHES_OFF,
                loss_tile: int = DEFAULT_LOSS_TILE, mlp_tile: int | None = None,
                sp_schedule: str = "static", tp: int = 1, ep: int = 1, experts: int = 0, top_k: int = 0,
                expert_intermediate: int | None = None, param_bytes: int | None = None, state_bytes: int = 4,
                offload_states: bool = False, fused_norm: bool = False) -> StepMemory:
    """Bytes per rank of one training step with ``tokens`` tokens on this rank (the largest shard:
    :func:`seqpar.planner.cost.largest_shard`; a dynamic schedule's bin: its token budget).
    ``loss_tile`` / ``mlp_tile`` are the tiles the library uses when ``switches`` gives none;
    ``mlp_tile`` None: the library's rule, :func:`seqpar.batch.tiles.mlp_tile_for` of this shard.
    ``sp_schedule="dynamic"`` with ``fsdp_shards > 1``: the parameters and gradients held whole for the
    step (``gathered``). ``tp``: tensor-parallel degree; ``experts`` / ``top_k`` /
    ``expert_intermediate`` / ``ep``: an MoE model's experts and expert parallelism (module doc).
    ``param_bytes``: bytes of a stored weight and gradient (default ``dtype_bytes``; 4 for float32
    master weights under bfloat16 compute, as FSDP2's mixed precision keeps them); ``state_bytes``: of
    an AdamW state; ``offload_states``: weights, gradients and AdamW states live in host memory
    (DeepSpeed ZeRO-3 with offloaded parameters and optimizer, FSDP2's CPUOffloadPolicy), the device
    holding one layer's weights and gradients at a time; ``fused_norm``: RMSNorm is one fused kernel
    (Liger's) that keeps no float32 copy of a narrower input (transformers' own RMSNorm keeps one).
    Raises ValueError for a non-positive size or an unknown schedule."""
    if sp_schedule not in SP_SCHEDULES:
        raise ValueError(f"sp_schedule={sp_schedule!r}: choose one of {', '.join(SP_SCHEDULES)}")
    sizes = dict(tokens=tokens, hidden_size=hidden_size, intermediate_size=intermediate_size, layers=layers,
                 heads=heads, kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab_size,
                 dtype_bytes=dtype_bytes, fsdp_shards=fsdp_shards, loss_tile=loss_tile, tp=tp, ep=ep,
                 mlp_tile=mlp_tile_for(tokens, hidden_size, intermediate_size) if mlp_tile is None else mlp_tile)
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    t, h, i, b, d = tokens, hidden_size, intermediate_size, dtype_bytes, head_dim
    q, g = heads * d, kv_heads * d
    split, whole, expert = parameter_parts(hidden_size=h, intermediate_size=i, layers=layers, heads=heads,
                                           kv_heads=kv_heads, head_dim=d, vocab_size=vocab_size, tied=tied,
                                           experts=experts, expert_intermediate=expert_intermediate)
    n = -(-split // tp) + whole + -(-expert // ep)  # this rank's parameters
    pb = b if param_bytes is None else param_bytes
    weights = -(-n // fsdp_shards) * pb
    optimizer = ADAM_STATES * -(-n // fsdp_shards) * state_bytes
    gathered = n * (b + max(b, 4)) if sp_schedule == "dynamic" and fsdp_shards > 1 else 0
    if offload_states:  # one layer's weights (in the compute dtype) and their gradient on the device
        weights, optimizer, gathered = -(-n // layers) * b, 0, -(-n // layers) * b

    vocab = -(-vocab_size // tp)  # the vocabulary-parallel head's rows on this rank
    rows = min(t, switches.loss_tile or loss_tile) if switches.tiled_loss else t
    own = b if b < 4 else 0  # a narrower dtype's own copy beside the float32 one the loss works on
    if switches.tiled_loss:  # one tile alive: its log-sum-exp, then its gradient (module doc)
        lse = rows * vocab * (own + 4 + (4 if tp > 1 else 0))  # logits, float32 copy, (tp) exponentials
        product = vocab * h * (b + 4) if b < 4 else 0  # a narrower tile's grad_w product and its float32 copy
        logits = max(lse, TILE_COPIES * rows * vocab * (4 + own) + product)
    elif tp > 1:  # the shard's logits, their float32 copy (for a narrower dtype), their exponentials or gradient
        logits = rows * vocab * (own + 4 + 4)
    else:
        logits = LOGIT_COPIES * t * vocab * 4
    mlp_tokens = min(t, switches.mlp_tile or sizes["mlp_tile"]) if switches.tiled_mlp else t
    if experts:  # the experts' intermediates of the tokens routed here, and the router's fp32 logits / probs
        width, mlp_tokens, router = expert_intermediate or i, top_k * t, 2 * t * experts * 4
    else:
        width, router = -(-i // tp), 0
    mlp_one = MLP_COPIES * mlp_tokens * width * b + router  # one layer's MLP intermediates
    mlp_flight = (MLP_COPIES - MLP_SAVED) * mlp_tokens * width * b  # of them, the gradient in flight (backward)
    norm = 4 * t * h if b < 4 and not fused_norm else 0  # RMSNorm's float32 copy of a narrower input, kept
    # the rest of one layer (the residual stream whole, the heads' tensors split over tp); the kernel's fp32 lse
    rest_one = t * (4 * h + (3 * q + 2 * g) // tp) * b + 4 * t * heads // tp + 2 * norm
    other = 4 * t * h * b + norm
    grads = 0 if offload_states else weights  # offloaded: the gathered layer's gradient is in `gathered`
    head = vocab * h * max(b, 4) + (t * h * b if switches.tiled_loss else 0)  # the tiled loss's grad_w, grad_h
    if switches.checkpoint == "none":
        return StepMemory(weights, grads, optimizer, logits, layers * mlp_one, layers * rest_one, other, 0, gathered,
                          kept=layers * (mlp_one - mlp_flight + rest_one), recompute=mlp_flight, head_gradient=head)
    inputs = layers * t * h * b  # each layer's input, kept for the recompute
    offloaded = inputs if switches.checkpoint == "offload" else 0
    return StepMemory(weights, grads, optimizer, logits, mlp_one, rest_one + inputs - offloaded, other, offloaded,
                      gathered, kept=inputs - offloaded, recompute=rest_one + mlp_one, head_gradient=head)
