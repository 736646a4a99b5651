"""The cost model of the planner: bytes moved and activation memory of one ``dp x ulysses x ring``
split (the formulas are in :mod:`seqpar.planner`'s docstring). Pure arithmetic."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from ..attention.heads import head_ranges, kv_index
from ..comm.collectives import split_sizes


class SplitShape:
    """What a planned split says of its SP degrees, in one place: ``sp`` (ulysses x ring), the
    ``strategy`` they make and whether it is ``feasible`` (no ``why_not``)."""

    ulysses: int
    ring: int
    why_not: tuple[str, ...]

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def feasible(self) -> bool:
        return not self.why_not

    @property
    def strategy(self) -> str:
        """``"hybrid"``, ``"ring"`` or ``"ulysses"`` (also for ``sp == 1``, where it is the identity)."""
        if self.ring > 1:
            return "hybrid" if self.ulysses > 1 else "ring"
        return "ulysses"


@dataclass(frozen=True)
class Candidate(SplitShape):
    """One ``dp x ulysses x ring`` split with its estimates (bytes per rank, forward, per layer)."""

    dp: int
    ulysses: int
    ring: int
    ulysses_bytes: int
    ring_bytes: int
    inter_node_bytes: int  # the part of the comm bytes that crosses node links
    memory_bytes: int  # activation memory per rank, all layers
    kv_copies: int  # KV heads summed over the ulysses ranks (> kv_heads when replicated)
    kv_replication: float  # kv_copies / kv_heads
    idle: float  # fraction of attention capacity idle from uneven heads
    spans_nodes: bool  # the ulysses all-to-all crosses node links
    why_not: tuple[str, ...] = ()

    @property
    def comm_bytes(self) -> int:
        return self.ulysses_bytes + self.ring_bytes

    @property
    def label(self) -> str:
        return f"dp={self.dp} x ulysses={self.ulysses} x ring={self.ring}"


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def estimate(dp: int, u: int, r: int, *, heads: int, kv_heads: int, head_dim: int, hidden_size: int,
              devices_per_node: int, seq_len: int, layers: int, dtype_bytes: int, batch: int,
              intermediate_size: int, causal: bool, checkpointing: bool) -> Candidate:
    sp, n, d, b = u * r, devices_per_node, head_dim, dtype_bytes
    q_ranges, kv_ranges = head_ranges(heads, kv_heads, u)
    kv_copies = sum(k for _, k in kv_ranges)
    kv_used = [_kv_heads_used(qr, kr, heads // kv_heads) for qr, kr in zip(q_ranges, kv_ranges, strict=True)]
    q_max, kv_max = max(k for _, k in q_ranges), max(kv_used)
    tokens = seq_len / sp  # average per rank: the bytes are averages over ranks
    ulysses_bytes = batch * b * (u - 1) / u * tokens * (2 * heads * d + 2 * kv_copies * d)
    ring_bytes = batch * b * 2 * (r - 1) * tokens * sum(kv_used) * d
    inter = ulysses_bytes * _ulysses_off_node(u, n) + ring_bytes * _ring_off_node(u, r, n)

    t = largest_shard(seq_len, u, r, zigzag=causal and r > 1)
    saved = t * (4 * hidden_size + heads * d + 4 * intermediate_size) * b \
        + u * t * ((2 * q_max + 2 * kv_max) * d * b + 4 * q_max)
    running = u * t * (2 * q_max + 2 * kv_max) * d * b
    if r > 1:
        running += u * t * (2 * kv_max * d * b + 16 * kv_max * d + 4 * q_max * (d + 1))
    kept = layers * t * hidden_size * b + saved if checkpointing else layers * saved
    memory = batch * (kept + running)
    return Candidate(dp, u, r, round(ulysses_bytes), round(ring_bytes), round(inter), memory, kv_copies,
                     kv_copies / kv_heads, 1 - heads / (u * q_max), spans_nodes=u > 1 and n % u != 0)


def _kv_heads_used(q_range: tuple[int, int], kv_range: tuple[int, int], group: int) -> int:
    """KV heads a ulysses rank's kernel (and hybrid ring) works on: the ones it received, or one copy
    per query head when its query heads do not line up with whole GQA groups (as ``heads_to_seq``
    expands them, e.g. query heads 0-2 of groups of 2 read KV heads 0, 0, 1)."""
    return kv_range[1] if kv_index(q_range, kv_range, group) is None else q_range[1]


def largest_shard(seq_len: int, u: int, r: int, *, zigzag: bool) -> int:
    """Most tokens on one rank, as :mod:`seqpar.attention.layout` splits them."""
    if not zigzag:
        return -(-seq_len // (u * r))
    chunks = split_sizes(seq_len, 2 * r)
    return max(split_sizes(chunks[i] + chunks[2 * r - 1 - i], u)[0] for i in range(r))


def _ulysses_off_node(u: int, n: int) -> float:
    """Fraction of all-to-all traffic between ranks on different nodes (equal traffic per pair)."""
    if u == 1:
        return 0.0
    period, off = math.lcm(u, n), 0
    for start in range(0, period, u):
        per_node = Counter((start + i) // n for i in range(u))
        off += u * u - sum(c * c for c in per_node.values())
    return off / ((period // u) * u * (u - 1))


def _ring_off_node(u: int, r: int, n: int) -> float:
    """Fraction of ring ranks whose next ring neighbour (``u`` ranks further, cyclic) is on another node."""
    if r == 1:
        return 0.0
    sp = u * r
    period, off = math.lcm(sp, n), 0
    for base in range(0, period, sp):
        for j in range(u):
            nodes = [(base + j + i * u) // n for i in range(r)]
            off += sum(nodes[i] != nodes[(i + 1) % r] for i in range(r))
    return off / ((period // sp) * u * r)
