"""The planner at scale: ``dp_replicate x dp_shard x sp (ulysses x ring) x tp`` and ``ep`` for a
model on ``gpus`` devices of ``gpu_memory`` bytes, with the lightest memory switches that fit. Pure
arithmetic, no communication.

Every factorisation of the devices in :func:`seqpar.init_mesh`'s order (tp innermost, inside a
node; sp next; the data-parallel dimensions outermost) with tp dividing the heads, the KV heads and
the node, and ep (MoE) dividing the experts and ``dp_shard x sp``, is a candidate. For each, the
lightest switches of :data:`SWITCH_LADDER` whose per-rank memory
(:func:`seqpar.planner.memory.step_memory`: FSDP2 over ``dp_shard x sp``, float32 master weights
and AdamW states, ``dtype`` activations; its ``phase_peak``, the estimate checked within 10% of
measured peaks in tests/planner/test_nd_memory_model.py) fits the budget. Bytes per rank and per layer, forward
(the backward moves about as much again), per dimension::

    sp    Ulysses' all-to-alls and ring's K/V hops over each tp rank's heads (seqpar.planner)
    tp    2 all-reduces of [T, h] (attention and MLP outputs):  2 * 2 (tp-1)/tp * T*h*b
    dp    FSDP2's all-gather of this layer's weights over dp_shard x sp:  (F-1)/F * n_layer/tp * b
          (HSDP: once per step, the all-reduce of the gradients over dp_replicate: counted per layer)
    ep    the token dispatch and combine all-to-alls: 2 * (ep-1)/ep * top_k * T*h*b  (MoE layers)

and the part of it that crosses node links. The choice, among the candidates that fit: the least
time on the links (intra-node bytes over ``intra_bw`` plus inter-node bytes over ``inter_bw``),
then the lightest switches, then the fewest tensor-parallel ranks. :func:`plan_nd` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .cost import SplitShape, divisors, estimate, largest_shard
from .memory import MemorySwitches, StepMemory, parameter_parts, step_memory

SWITCH_LADDER: tuple[MemorySwitches, ...] = (
    MemorySwitches(),
    MemorySwitches(tiled_loss=True),
    MemorySwitches(tiled_loss=True, tiled_mlp=True),
    MemorySwitches(tiled_loss=True, checkpoint="layers"),
    MemorySwitches(tiled_loss=True, tiled_mlp=True, checkpoint="layers"),
    MemorySwitches(tiled_loss=True, checkpoint="offload"),
    MemorySwitches(tiled_loss=True, tiled_mlp=True, checkpoint="offload"),
)
"""The memory switches tried, lightest first (each one costs recompute or copies); an MoE model
skips the tiled MLP."""


MOE_KEYS = {"experts": ("num_local_experts", "num_experts", "n_routed_experts"),
            "top_k": ("num_experts_per_tok", "moe_topk", "top_k"),
            "expert_intermediate": ("moe_intermediate_size", "expert_intermediate_size")}
"""An MoE config's expert count, experts per token and expert width, by transformers' key names."""


def moe_fields(config: dict[str, Any]) -> dict[str, int]:
    """``{experts, top_k, expert_intermediate}`` of a decoder config (a dict): the first non-zero
    value of each :data:`MOE_KEYS` name, 0 where there is none."""
    return {k: next((int(config[n]) for n in names if config.get(n)), 0) for k, names in MOE_KEYS.items()}


@dataclass(frozen=True)
class ModelShape:
    """A Llama-shaped decoder (an MoE one when ``experts`` > 0)."""

    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int | None = None


@dataclass(frozen=True)
class Layout(SplitShape):
    """One N-D candidate, its memory, its bytes per layer per dimension, and why it is out."""

    dp_replicate: int
    dp_shard: int
    ulysses: int
    ring: int
    tp: int
    ep: int
    switches: MemorySwitches
    memory: StepMemory
    bytes_per_layer: dict[str, int]  # forward, per rank: "sp", "tp", "dp", "ep"
    inter_node: dict[str, int]  # the part of each that crosses node links
    seconds_per_layer: float
    why_not: tuple[str, ...] = ()

    def mesh_kwargs(self) -> dict[str, int]:
        """Keyword arguments of :func:`seqpar.init_mesh` for this layout."""
        kw = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        if self.strategy == "hybrid":
            kw.update(ulysses=self.ulysses, ring=self.ring)
        else:
            kw["sp"] = self.sp
        if self.ep > 1:
            kw["ep"] = self.ep
        return kw

    @property
    def label(self) -> str:
        sp = f"sp={self.sp}" + (f" (ulysses {self.ulysses} x ring {self.ring})" if self.ring > 1 else "")
        return (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} {sp} tp={self.tp}"
                + (f" ep={self.ep}" if self.ep > 1 else ""))


@dataclass(frozen=True)
class NdPlan:
    chosen: Layout
    reason: str
    candidates: tuple[Layout, ...] = field(repr=False)


def layout_bytes(shape: ModelShape, *, seq_len: int, gpus_per_node: int, dtype_bytes: int, dp_replicate: int,
           dp_shard: int, u: int, r: int, tp: int, ep: int, causal: bool) -> tuple[dict[str, int], dict[str, int]]:
    """``(bytes per layer per dimension, their inter-node part)`` of one layout (module doc), forward,
    per rank: ``{"sp", "tp", "dp", "ep"}``."""
    b, h, sp = dtype_bytes, shape.hidden_size, u * r
    c = estimate(dp_replicate * dp_shard, u, r, heads=shape.heads // tp, kv_heads=shape.kv_heads // tp,
                 head_dim=shape.head_dim, hidden_size=h, devices_per_node=max(1, gpus_per_node // tp),
                 seq_len=seq_len, layers=1, dtype_bytes=b, batch=1, intermediate_size=shape.intermediate_size,
                 causal=causal, checkpointing=False)
    t = seq_len / sp
    split, whole, expert = parameter_parts(hidden_size=h, intermediate_size=shape.intermediate_size, layers=1,
                                           heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                                           vocab_size=0, experts=shape.experts,
                                           expert_intermediate=shape.expert_intermediate)
    layer = split / tp + whole + expert / ep  # this rank's share of one layer's weights
    f = dp_shard * sp
    fsdp = (f - 1) / f * layer * b + (2 * (dp_replicate - 1) / dp_replicate * layer * 4 / shape.layers
                                     if dp_replicate > 1 else 0)
    out = {"sp": c.comm_bytes, "tp": round(2 * 2 * (tp - 1) / tp * t * h * b), "dp": round(fsdp),
           "ep": round(2 * (ep - 1) / ep * shape.top_k * t * h * b) if shape.experts else 0}
    ranks_per_node = gpus_per_node
    shard_span = dp_shard * sp * tp  # consecutive ranks of one FSDP shard group (and its tp ranks)
    inter = {"sp": c.inter_node_bytes, "tp": 0 if tp <= ranks_per_node else out["tp"],
             "dp": round((f - 1) / f * layer * b) if shard_span > ranks_per_node else 0,
             "ep": out["ep"] if ep * tp > ranks_per_node else 0}
    if dp_replicate > 1:
        inter["dp"] += round(2 * (dp_replicate - 1) / dp_replicate * layer * 4 / shape.layers)
    return out, inter


def plan_nd(shape: ModelShape, *, gpus: int, gpus_per_node: int, gpu_memory: int, seq_len: int,
            dtype_bytes: int = 2, causal: bool = True, intra_bw: float = 450e9, inter_bw: float = 50e9,
            max_tp: int | None = None) -> NdPlan:
    """Choose the N-D layout and the memory switches (module doc). Raises ValueError for sizes that
    do not work together (``gpus_per_node`` not dividing ``gpus``), and when no candidate fits
    ``gpu_memory``, naming the leanest one and what it needs."""
    if gpus < 1 or gpus_per_node < 1 or gpus % gpus_per_node and gpus > gpus_per_node:
        raise ValueError(f"--gpus {gpus} must be a multiple of --gpus-per-node {gpus_per_node} (whole nodes)")
    node = min(gpus_per_node, gpus)
    cands: list[Layout] = []
    for tp in divisors(gpus):
        if node % tp or shape.heads % tp or shape.kv_heads % tp or (max_tp is not None and tp > max_tp):
            continue
        for sp in divisors(gpus // tp):
            dp = gpus // (tp * sp)
            for u in divisors(sp):
                r = sp // u
                if u > shape.heads // tp or seq_len < sp or (causal and r > 1 and seq_len < 2 * r):
                    continue
                for dp_replicate in divisors(dp):
                    dp_shard = dp // dp_replicate
                    eps = [e for e in divisors(dp_shard * sp) if shape.experts % e == 0] if shape.experts else [1]
                    for ep in eps:
                        cands.append(_candidate(shape, seq_len, gpus_per_node, gpu_memory, dtype_bytes, causal,
                                                dp_replicate, dp_shard, u, r, tp, ep, intra_bw, inter_bw))
    ok = [c for c in cands if c.feasible]
    if not ok:
        lean = min(cands, key=lambda c: c.memory.phase_peak())
        raise ValueError(f"no layout of {gpus} GPUs fits {seq_len} tokens in {gpu_memory / 2**30:.1f} GiB per GPU: "
                         f"the leanest ({lean.label}, switches {lean.switches.label}) needs "
                         f"{lean.memory.phase_peak() / 2**30:.1f} GiB; use more GPUs, a shorter sequence or a "
                         "smaller model")
    ladder = {sw: i for i, sw in enumerate(SWITCH_LADDER)}
    best = min(ok, key=lambda c: (round(c.seconds_per_layer, 9), ladder[c.switches], c.tp, c.ring, -c.ep))
    return NdPlan(best, _reason(best, cands, gpu_memory, gpus_per_node), tuple(cands))


def _candidate(shape: ModelShape, seq_len: int, gpus_per_node: int, gpu_memory: int, b: int, causal: bool,
               dp_replicate: int, dp_shard: int, u: int, r: int, tp: int, ep: int, intra_bw: float,
               inter_bw: float) -> Layout:
    t = largest_shard(seq_len, u, r, zigzag=causal and r > 1)
    kw = dict(tokens=t, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
              layers=shape.layers, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
              vocab_size=shape.vocab_size, dtype_bytes=b, tied=shape.tied, fsdp_shards=dp_shard * u * r,
              param_bytes=4, tp=tp, ep=ep, experts=shape.experts, top_k=shape.top_k,
              expert_intermediate=shape.expert_intermediate)
    # an MoE block is not tiled (seqpar.reduce_memory refuses tiled_mlp there: its router sees every token)
    ladder = [sw for sw in SWITCH_LADDER if not (shape.experts and sw.tiled_mlp)]
    switches, memory = ladder[-1], step_memory(**kw, switches=ladder[-1])
    for sw in ladder:
        m = step_memory(**kw, switches=sw)
        if m.phase_peak() <= gpu_memory:
            switches, memory = sw, m
            break
    per, inter = layout_bytes(shape, seq_len=seq_len, gpus_per_node=gpus_per_node, dtype_bytes=b,
                        dp_replicate=dp_replicate, dp_shard=dp_shard, u=u, r=r, tp=tp, ep=ep, causal=causal)
    seconds = sum((per[k] - inter[k]) / intra_bw + inter[k] / inter_bw for k in per)
    peak = memory.phase_peak()
    why = () if peak <= gpu_memory else (f"{peak / 2**30:.1f} GiB > {gpu_memory / 2**30:.1f} GiB with every switch on",)
    return Layout(dp_replicate, dp_shard, u, r, tp, ep, switches, memory, per, inter, seconds, why)


def _reason(best: Layout, cands: list[Layout], gpu_memory: int, gpus_per_node: int) -> str:
    fit = sum(c.feasible for c in cands)
    text = (f"{fit} of {len(cands)} layouts fit {gpu_memory / 2**30:.1f} GiB per GPU; this one spends the least time "
            f"on the links per layer ({best.seconds_per_layer * 1e3:.2f} ms forward at the assumed bandwidths)")
    if best.switches.any:
        text += (f", with the memory switches {best.switches.label} (the lightest that fit: "
                 f"{best.memory.phase_peak() / 2**30:.1f} GiB per GPU)")
    else:
        text += f", without memory switches ({best.memory.phase_peak() / 2**30:.1f} GiB per GPU)"
    if best.tp > 1:
        text += f"; tp={best.tp} inside a node of {gpus_per_node} (two all-reduces per layer need its links)"
    if best.sp > 1:
        text += f"; sp={best.sp} splits the sequence ({best.strategy})"
    if best.dp_replicate > 1:
        text += f"; HSDP: FSDP2 shards inside each of {best.dp_replicate} replicas, which all-reduce once per step"
    if best.ep > 1:
        text += f"; ep={best.ep} ranks of dp_shard x sp share the experts"
    return text
