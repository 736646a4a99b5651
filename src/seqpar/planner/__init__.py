"""Choose ``dp x ulysses x ring`` for a model and a cluster. Pure arithmetic, no communication.

Every factorisation ``world = dp * ulysses * ring`` is a candidate (``sp = ulysses * ring`` ranks
share one sequence). Ranks are laid out as in :func:`seqpar.init_mesh`: ulysses innermost, then
ring, then dp, and node by node (rank ``i`` lives on node ``i // devices_per_node``).

Estimated communication per rank and per layer, forward only (backward moves about as much again).
Notation: ``N`` tokens, ``T = N / sp`` tokens per rank, ``d`` head dim, ``h = H * d`` (query
width), ``U`` ulysses, ``R`` ring, ``b`` bytes per element, ``B`` sequences per step::

    ulysses = B * b * (U-1)/U * T * (2h + 2g')
    ring    = B * b * 2 * (R-1) * T * g''         (U = 1: 2 * N * g * (R-1)/R)

* Ulysses: the all-to-all in moves this rank's q (``h``), k and v (``g'`` each) except the 1/U share
  it keeps; the one back moves ``out`` (``h``). ``g' = d * sum_r kv_heads(r)`` counts each KV head
  once per ulysses rank that receives it (:func:`seqpar.attention.heads.head_ranges`): with ``H_kv < U``, or uneven
  query heads, a KV head goes to several ranks and ``g'`` exceeds ``g = H_kv * d``.
* Ring: each rank keeps its queries and passes K and V blocks ``R-1`` hops. After the ulysses
  all-to-all a rank holds ``N/R`` tokens of its ``kv(r)`` KV heads, so a hop carries
  ``2 * (N/R) * kv(r) * d`` elements: ``2 * T * g''`` on average with ``g'' = d * sum_r kv(r)``.
  ``kv(r)`` is what rank r received, except where its query heads do not line up with whole GQA
  groups (3 query heads of groups of 2): Ulysses then gives each query head its own KV copy and the
  ring moves those. Usually ``g'' = g'``. Pure ring is the classic ``2 N g (R-1)/R``.
* Uneven heads (``H % U != 0``) leave some capacity idle: ``idle = 1 - H / (U * ceil(H/U))``.

Estimated activation memory per rank (rough; weights, gradients, optimizer states and the LM head's
logits are not included, so give as budget what remains after them). ``T`` here is the largest
shard (zigzag chunks included), ``I`` the MLP width (default ``4 * hidden``), ``q``/``kv`` the
largest query / ``kv(r)`` head counts of a ulysses rank::

    per layer, kept for backward = B * (T * (4*hidden + h + 4*I) * b       norms, o-proj input, SwiGLU
                                      + U*T * ((2q + 2kv) * d * b + 4q))   kernel's q, k, v, out, lse
    once, while a layer runs     = B * (U*T * (2q + 2kv) * d * b          their gradients
                                      + ring: U*T * (2kv*d*b + 16kv*d + 4q*(d+1)))
                                        K/V receive buffers, fp32 dK/dV in flight, fp32 out/lse merge

With ``checkpointing`` only each layer's input (``T * hidden``) is kept, plus one layer's full set
while it is recomputed.

The whole step's memory per rank -- weights, gradients, AdamW states, logits and activations with and
without each of :func:`seqpar.reduce_memory`'s switches -- is :func:`seqpar.planner.memory.step_memory`
(checked against measured peaks; ``seqpar plan`` prints it for the chosen split).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace

from .cost import Candidate, divisors, estimate


@dataclass(frozen=True)
class Plan(Candidate):
    """The chosen split -- a :class:`~seqpar.planner.cost.Candidate`: ``dp``, ``ulysses``, ``ring``,
    ``sp``, ``strategy`` and its estimates --, why, and every candidate considered (see :func:`plan`)."""

    reason: str = ""
    candidates: tuple[Candidate, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, chosen: Candidate, reason: str, candidates: tuple[Candidate, ...]) -> Plan:
        return cls(**{f.name: getattr(chosen, f.name) for f in fields(Candidate)}, reason=reason,
                   candidates=candidates)

    @property
    def chosen(self) -> Candidate:
        return Candidate(**{f.name: getattr(self, f.name) for f in fields(Candidate)})

    def mesh_kwargs(self) -> dict[str, int]:
        """Keyword arguments for :func:`seqpar.init_mesh` that build this split."""
        kw = {"sp": self.sp, "dp": self.dp}
        if self.strategy == "hybrid":
            kw.update(ulysses=self.ulysses, ring=self.ring)
        return kw

    def table(self) -> str:
        return format_table(self.candidates, self.chosen)


class InfeasiblePlanError(ValueError):
    """No candidate fits. ``candidates`` holds them all, each with its ``why_not``."""

    def __init__(self, message: str, candidates: tuple[Candidate, ...]):
        super().__init__(message)
        self.candidates = candidates


_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_size(text: str) -> int:
    """``"80GiB"`` -> bytes, ``"1M"`` -> 1048576; binary for bare K/M/G/T, decimal for KB/MB/GB/TB.
    Raises ValueError for text that is not a size."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size: use e.g. 131072, 1M, 80GiB or 40GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(candidates: tuple[Candidate, ...], chosen: Candidate | None = None) -> str:
    """The candidate table as text, largest sp first; ``*`` marks the chosen one."""
    head = f"  {'dp':>4} {'ulysses':>7} {'ring':>5} {'comm/layer':>11} {'inter-node':>11} {'memory/rank':>11}" \
           f" {'idle':>5}  ok / why not"
    lines = [head, "  " + "-" * (len(head) - 2)]
    for c in sorted(candidates, key=lambda c: (-c.sp, -c.ulysses)):
        mark = "*" if c == chosen else " "
        lines.append(f"{mark} {c.dp:>4} {c.ulysses:>7} {c.ring:>5} {format_bytes(c.comm_bytes):>11}"
                     f" {format_bytes(c.inter_node_bytes):>11} {format_bytes(c.memory_bytes):>11}"
                     f" {c.idle:>5.0%}  {'ok' if c.feasible else '; '.join(c.why_not)}")
    return "\n".join(lines)


def plan(*, heads: int, kv_heads: int, head_dim: int, hidden_size: int, world_size: int, devices_per_node: int,
         seq_len: int, layers: int = 1, dtype_bytes: int = 2, memory_budget_bytes: int | None = None,
         batch: int = 1, max_ulysses: int | None = None, intermediate_size: int | None = None,
         causal: bool = True, checkpointing: bool = False) -> Plan:
    """Choose ``dp x ulysses x ring`` over ``world_size`` ranks for a model and sequence length.

    Rules out, with the reason: ulysses above the query-head count (or ``max_ulysses``); ulysses
    groups that straddle nodes (a ulysses degree that neither divides ``devices_per_node`` nor is a
    multiple of it); fewer tokens than ranks (or than the ``2 * ring`` zigzag chunks when
    ``causal``); activation memory over ``memory_budget_bytes``. Then picks the sp: with a budget
    the smallest that fits (the rest goes to dp), without one all ranks. Within it, in order:
    ulysses inside a node, even head split, pure Ulysses, no replicated KV heads, larger ulysses,
    fewer bytes. ``batch`` is the sequences one sp group processes per step.

    Raises ValueError for bad arguments, and :class:`InfeasiblePlanError` (a ValueError carrying
    the candidate table) when no split fits, saying what to change.
    """
    _check_args(heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden_size, world_size=world_size,
                devices_per_node=devices_per_node, seq_len=seq_len, layers=layers, dtype_bytes=dtype_bytes,
                batch=batch, memory_budget_bytes=memory_budget_bytes, max_ulysses=max_ulysses,
                intermediate_size=intermediate_size)
    shape = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden_size,
                 devices_per_node=devices_per_node, seq_len=seq_len, layers=layers, dtype_bytes=dtype_bytes,
                 batch=batch, intermediate_size=intermediate_size or 4 * hidden_size, causal=causal,
                 checkpointing=checkpointing)
    cands = []
    for sp in divisors(world_size):
        for u in divisors(sp):
            c = estimate(world_size // sp, u, sp // u, **shape)
            why = _why_not(c, heads=heads, devices_per_node=devices_per_node, seq_len=seq_len, causal=causal,
                           max_ulysses=max_ulysses, memory_budget_bytes=memory_budget_bytes)
            cands.append(replace(c, why_not=why))
    cands = tuple(cands)
    ok = [c for c in cands if c.feasible]
    if not ok:
        raise InfeasiblePlanError(_infeasible_message(cands, seq_len, world_size, memory_budget_bytes,
                                                      checkpointing), cands)
    sps = sorted({c.sp for c in ok})
    sp = sps[0] if memory_budget_bytes is not None else sps[-1]
    best = min((c for c in ok if c.sp == sp), key=_preference)
    return Plan.of(best, _reason(best, cands, heads, devices_per_node, world_size, memory_budget_bytes), cands)


def _check_args(**kw: int | None) -> None:
    optional = ("memory_budget_bytes", "max_ulysses", "intermediate_size")
    for name, v in kw.items():
        if v is None and name in optional:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if kw["heads"] % kw["kv_heads"]:
        raise ValueError(f"heads={kw['heads']} must be a multiple of kv_heads={kw['kv_heads']} (GQA groups)")
    if kw["world_size"] % kw["devices_per_node"]:
        raise ValueError(f"devices_per_node={kw['devices_per_node']} must divide world_size={kw['world_size']}"
                         f" (ranks fill nodes one by one): pass the devices this job uses on each node")


def _why_not(c: Candidate, *, heads: int, devices_per_node: int, seq_len: int, causal: bool,
             max_ulysses: int | None, memory_budget_bytes: int | None) -> tuple[str, ...]:
    why, u, n = [], c.ulysses, devices_per_node
    if u > heads:
        why.append(f"ulysses={u} > {heads} query heads")
    if max_ulysses is not None and u > max_ulysses:
        why.append(f"ulysses={u} > max_ulysses={max_ulysses}")
    if n % u and u % n:
        why.append(f"ulysses={u} groups straddle nodes of {n} (use a divisor or multiple of {n})")
    if seq_len < c.sp:
        why.append(f"{seq_len} tokens < sp={c.sp} ranks")
    elif causal and c.ring > 1 and seq_len < 2 * c.ring:
        why.append(f"{seq_len} tokens < {2 * c.ring} zigzag chunks (2*ring)")
    if memory_budget_bytes is not None and c.memory_bytes > memory_budget_bytes:
        why.append(f"memory {format_bytes(c.memory_bytes)} > budget {format_bytes(memory_budget_bytes)}")
    return tuple(why)


def _preference(c: Candidate) -> tuple:
    """Sort key within one sp: smaller is better (see :func:`plan`)."""
    return (c.spans_nodes, c.idle > 0, c.ring > 1, c.kv_replication > 1, -c.ulysses, c.comm_bytes)


def _reason(best: Candidate, cands: tuple[Candidate, ...], heads: int, devices_per_node: int, world_size: int,
            memory_budget_bytes: int | None) -> str:
    n, sp, u, r = devices_per_node, best.sp, best.ulysses, best.ring
    mem = format_bytes(best.memory_bytes)
    if memory_budget_bytes is not None:
        text = (f"sp={sp} is the smallest sequence-parallel degree whose activations fit the "
                f"{format_bytes(memory_budget_bytes)} budget ({mem} per rank)")
    else:
        text = f"no memory budget given, so the most ranks that work share each sequence: sp={sp} ({mem} per rank)"
        bigger = [c for c in cands if c.sp > sp]
        if bigger:
            text += f"; larger sp fails ({min(bigger, key=lambda c: (len(c.why_not), -c.sp)).why_not[0]})"
    if best.dp > 1:
        text += f", dp={best.dp} for the rest"
    if sp == 1:
        return text + "; no sequence parallelism: each rank holds whole sequences"
    parts = []
    if u > 1:
        where = f"inside each node of {n}" if not best.spans_nodes else f"across {u // n} nodes (inter-node all-to-all)"
        q_lo, q_hi = heads // u, -(-heads // u)
        q = f"{q_hi} query heads" if q_lo == q_hi else f"{q_lo}-{q_hi} query heads, {best.idle:.0%} idle"
        rep = f", KV heads sent {best.kv_replication:.2g}x" if best.kv_replication > 1 else ""
        parts.append(f"ulysses={u} {where} ({q} per rank{rep})")
    if r > 1:
        parts.append(f"ring={r} {'across nodes' if sp > n else 'inside a node'}")
    text += "; " + " x ".join(parts)
    if r > 1:
        pure = next(c for c in cands if c.sp == sp and c.ring == 1)
        if not pure.feasible:
            text += f"; pure Ulysses over {sp} is out ({pure.why_not[0]})"
        elif pure.spans_nodes:
            text += f"; pure Ulysses over {sp} would run its all-to-all across nodes"
        elif pure.idle > 0:
            text += f"; pure Ulysses over {sp} would leave {pure.idle:.0%} of the heads' work idle"
    text += (f"; ~{format_bytes(best.comm_bytes)} per rank per layer forward"
             f" ({format_bytes(best.inter_node_bytes)} over node links)")
    cheap = min((c for c in cands if c.feasible and c.sp == sp), key=lambda c: c.comm_bytes)
    if cheap.comm_bytes * 2 < best.comm_bytes:
        text += (f". Note: ulysses={cheap.ulysses} x ring={cheap.ring} moves "
                 f"{best.comm_bytes / cheap.comm_bytes:.1f}x fewer bytes; prefer it if links are slow")
    return text


def _infeasible_message(cands: tuple[Candidate, ...], seq_len: int, world_size: int,
                        memory_budget_bytes: int | None, checkpointing: bool) -> str:
    head = f"no split of {seq_len} tokens over {world_size} ranks fits"
    memory_only = [c for c in cands if all(w.startswith("memory") for w in c.why_not)]
    if memory_budget_bytes is not None and memory_only:
        lean = min(memory_only, key=lambda c: (c.memory_bytes, _preference(c)))
        need, factor = lean.memory_bytes, lean.memory_bytes / memory_budget_bytes
        return (f"{head} the activation budget of {format_bytes(memory_budget_bytes)} per rank: the leanest "
                f"({lean.label}) needs {format_bytes(need)}. Raise the memory budget to >= {format_bytes(need)}, "
                f"use about {math.ceil(factor)}x the devices, shorten the sequence to about "
                f"{int(seq_len / factor)} tokens{'' if checkpointing else ', or enable activation checkpointing'}")
    closest = min(cands, key=lambda c: (len(c.why_not), c.memory_bytes))
    return f"{head}: the closest, {closest.label}, fails because {'; '.join(closest.why_not)}"


def hybrid_split(sp: int, heads: int | None = None) -> tuple[int, int]:
    """``(ulysses, ring)`` for the hybrid strategy on ``sp`` ranks: the largest ulysses degree that
    leaves a ring of at least 2 and does not exceed the query-head count. Raises ValueError when no
    such split exists (sp prime or below 4)."""
    options = [u for u in range(2, sp) if sp % u == 0 and sp // u >= 2 and (heads is None or u <= heads)]
    if not options:
        cap = "" if heads is None else f", ulysses <= {heads} heads"
        raise ValueError(f"strategy 'hybrid' cannot split sp={sp} into ulysses x ring (each >= 2{cap}): use "
                         "strategy 'ulysses' or 'ring'")
    u = max(options)
    return u, sp // u
