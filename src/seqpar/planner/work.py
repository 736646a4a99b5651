"""Predicted seconds of one bin of packed documents at one SP degree: the cost model a dynamic
schedule (:mod:`seqpar.planner.schedule`) balances with. Pure arithmetic.

Per rank, for a bin of documents ``L_1..L_n`` (``T = sum L_i`` tokens) at degree ``k``::

    work    = (linear * T / flops_per_s + attention * sum L_i^2 / attention_flops_per_s) / k
            + n * doc_s                                             (every rank, whatever k)
    seconds = bin_s + work                                           (k = 1)
    seconds = bin_s + scale(k) * work                                (k > 1)
            + 2 * layers * bytes_per_layer(T, k) / bytes_per_s      (forward + backward)
            + layers * layer_s(k)                                   (a layer's fixed cost at degree k)

``linear`` counts the matmul FLOPs per token of forward + backward (3x the forward's): the q, k, v
and o projections, the SwiGLU MLP and the LM head; ``attention`` the per-document QK^T and PV
FLOPs (half of them under a causal mask). ``bytes_per_layer`` is the planner's Ulysses (or ring)
estimate of one layer's forward traffic (:func:`seqpar.planner.cost.estimate`). ``bin_s`` is a
forward + backward's fixed cost whatever its size (kernel launches, Python); ``doc_s`` a document's
(its attention kernel calls in every layer): every rank of a bin pays it for every document of the
bin, since each rank attends over all of them (for its heads, or its chunk), so a static schedule
that packs 48 short rows into sp=4 bins pays it 4 times over.

What a degree ``k > 1`` adds beyond its bytes is measured, not assumed:

- ``layer_s(k)``: a layer's fixed seconds -- the collectives' latency (four all-to-alls, so
  ``4 * collective_s`` unless measured) and per-call kernel overhead;
- ``scale(k)``: how much slower the same work runs per rank at degree ``k`` (1 unless measured).
  Every collective waits for the slowest of ``k`` ranks, so a degree-k bin pays its ranks' jitter
  at each of them; on a CPU whose ranks share cores, the ranks the OS has descheduled hold up the
  others at every collective (measured 1.0-2.0x at sp=4 on 2 shared cores, with the other jobs'
  load), while degree-1 bins keep every core busy.

The constants of a :class:`Machine` are refitted from measurements where there are some
(:func:`fit_machine` for compute at degree 1, :func:`fit_degrees` for each degree's terms);
:data:`H100` is a guess until then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .cost import estimate


@dataclass(frozen=True)
class Shapes:
    """What the cost model needs of a decoder model."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    layers: int
    vocab_size: int
    dtype_bytes: int = 2
    causal: bool = True

    @property
    def linear_flops(self) -> float:
        """Forward + backward matmul FLOPs per token (all layers and the LM head)."""
        h, q, g = self.hidden_size, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = h * (q + 2 * g) + q * h + 3 * h * self.intermediate_size
        return 6.0 * (self.layers * per_layer + h * self.vocab_size)

    @property
    def attention_flops(self) -> float:
        """Forward + backward attention FLOPs per squared document token (all layers)."""
        return 3.0 * 4.0 * self.heads * self.head_dim * self.layers * (0.5 if self.causal else 1.0)


@dataclass(frozen=True)
class Machine:
    """Throughputs of one rank: matmul FLOP/s, link bytes/s, one collective's fixed seconds, a
    forward + backward's fixed seconds (kernel launches, Python), each degree's fixed seconds per
    layer where measured, and a step's fixed seconds (gradient sync, planning)."""

    flops_per_s: float
    bytes_per_s: float
    collective_s: float = 0.0
    bin_s: float = 0.0
    attention_flops_per_s: float | None = None  # None: flops_per_s (a CPU kernel may differ from matmuls)
    doc_s: float = 0.0  # per document of a bin, on each of its ranks (fwd + bwd, all layers)
    layer_s: tuple[tuple[int, float], ...] = ()  # (degree, fixed seconds per layer, fwd + bwd), k > 1
    compute_scale: tuple[tuple[int, float], ...] = ()  # (degree, slowdown of a rank's compute), k > 1
    step_s: float = 0.0

    @property
    def attention_rate(self) -> float:
        return self.attention_flops_per_s or self.flops_per_s

    def layer_overhead(self, degree: int) -> float:
        """A layer's fixed seconds (forward + backward) at ``degree``: measured, else four
        collectives' latency; none at degree 1."""
        if degree == 1:
            return 0.0
        return dict(self.layer_s).get(degree, 4 * self.collective_s)

    def scale(self, degree: int) -> float:
        """How much slower a rank computes at ``degree`` than alone: measured, else 1."""
        return dict(self.compute_scale).get(degree, 1.0)


H100 = Machine(flops_per_s=4.0e14, bytes_per_s=1.5e11, collective_s=3e-5, bin_s=5e-3)
"""An H100 in bf16 at ~40% of its dense peak, NVLink all-to-all at ~150 GB/s per rank (guesses,
to be refitted on the machine: :func:`fit_machine`)."""


def bin_seconds(docs: Sequence[int], degree: int, shapes: Shapes, machine: Machine, *,
                strategy: str = "ulysses", devices_per_node: int = 8) -> float:
    """Predicted seconds per rank of one forward + backward of the documents ``docs`` (token
    counts, packed into one row) at SP degree ``degree``."""
    tokens = sum(docs)
    compute = shapes.linear_flops * tokens / machine.flops_per_s \
        + shapes.attention_flops * sum(n * n for n in docs) / machine.attention_rate
    seconds = machine.scale(degree) * (compute / degree + machine.doc_s * len(docs)) + machine.bin_s
    if degree > 1:
        seconds += 2 * shapes.layers * layer_bytes(tokens, degree, shapes, strategy=strategy,
                                                   devices_per_node=devices_per_node) / machine.bytes_per_s
        seconds += shapes.layers * machine.layer_overhead(degree)
    return seconds


def layer_bytes(tokens: int, degree: int, shapes: Shapes, *, strategy: str = "ulysses",
                devices_per_node: int = 8) -> float:
    """One layer's forward bytes per rank for ``tokens`` at ``degree`` (the planner's estimate)."""
    u, r = (degree, 1) if strategy == "ulysses" else (1, degree)
    c = estimate(1, u, r, heads=shapes.heads, kv_heads=shapes.kv_heads, head_dim=shapes.head_dim,
                 hidden_size=shapes.hidden_size, devices_per_node=devices_per_node, seq_len=max(tokens, degree),
                 layers=1, dtype_bytes=shapes.dtype_bytes, batch=1, intermediate_size=shapes.intermediate_size,
                 causal=shapes.causal, checkpointing=False)
    return float(c.comm_bytes)


def fit_machine(samples: Sequence[tuple[Sequence[int], float]], shapes: Shapes, *,
                bytes_per_s: float, collective_s: float) -> Machine:
    """Refit the compute constants from measured degree-1 seconds of bins (``(docs, seconds)``
    pairs) by least squares: ``s = linear_flops / F + c`` from two sizes; with three or more (one
    long document among them) the attention rate too, ``s = lin / F + att / A + c``; with four or
    more, some packing several documents, a document's cost too, ``+ n * doc_s``. The link
    constants come from a measured collective. Raises ValueError for fewer than two sizes."""
    lin = [shapes.linear_flops * sum(d) for d, _ in samples]
    att = [shapes.attention_flops * sum(n * n for n in d) for d, _ in samples]
    docs = [float(len(d)) for d, _ in samples]
    ys = [s for _, s in samples]
    if len(set(lin)) < 2:
        raise ValueError("fit_machine needs measurements of at least two bins of different sizes")
    link = dict(bytes_per_s=bytes_per_s, collective_s=collective_s)
    if len(samples) >= 4 and len(set(docs)) > 1:
        coef = _lstsq([lin, att, docs, [1.0] * len(ys)], ys)
        if coef[0] > 0 and coef[1] > 0 and coef[2] >= 0:
            return Machine(flops_per_s=1.0 / coef[0], attention_flops_per_s=1.0 / coef[1], doc_s=coef[2],
                           bin_s=max(coef[3], 0.0), **link)
    if len(samples) >= 3:
        coef = _lstsq([lin, att, [1.0] * len(ys)], ys)
        if coef[0] > 0 and coef[1] > 0:
            return Machine(flops_per_s=1.0 / coef[0], bin_s=max(coef[2], 0.0), attention_flops_per_s=1.0 / coef[1],
                           **link)
    xs = [x + y for x, y in zip(lin, att, strict=True)]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-30)
    return Machine(flops_per_s=1.0 / slope, bin_s=max(my - slope * mx, 0.0), **link)


def _lstsq(columns: list[list[float]], ys: list[float]) -> list[float]:
    import torch

    a = torch.tensor(columns, dtype=torch.float64).T
    return torch.linalg.lstsq(a, torch.tensor(ys, dtype=torch.float64)[:, None]).solution.flatten().tolist()


def fit_degrees(samples: Sequence[tuple[Sequence[int], int, float]], shapes: Shapes, machine: Machine, *,
                strategy: str = "ulysses", devices_per_node: int = 8) -> Machine:
    """``machine`` with each degree's ``scale(k)`` and ``layer_s(k)`` refitted from measured bins
    (``(docs, degree, seconds)``; degree-1 samples are ignored: :func:`fit_machine` fits those).
    Per degree, what ``bin_s`` and the bytes leave is a line in the compute term: its slope is
    ``scale(k)``, its intercept ``layers * layer_s(k)`` (least squares over two or more sizes; one
    size gives the intercept alone, at scale 1). Neither goes below what a measurement can mean: a
    rank does not compute faster at degree k than alone, nor pay a negative fixed cost, so a scale
    under 1 or an intercept under 0 is noise, clamped (and the other refitted): on a loaded machine
    a few noisy probes could otherwise fit sp=4 at half the cost of its work and a large fixed cost.
    Raises ValueError without a sample above degree 1."""
    base = replace(machine, layer_s=(), compute_scale=(), collective_s=0.0, bin_s=0.0)
    points: dict[int, list[tuple[float, float]]] = {}
    for docs, k, seconds in samples:
        if k > 1:
            x = bin_seconds(docs, k, shapes, base, strategy=strategy, devices_per_node=devices_per_node)
            bytes_s = bin_seconds(docs, k, shapes, replace(base, flops_per_s=float("inf"), doc_s=0.0,
                                                           attention_flops_per_s=float("inf")),
                                  strategy=strategy, devices_per_node=devices_per_node)
            points.setdefault(k, []).append((x - bytes_s, seconds - machine.bin_s - bytes_s))
    if not points:
        raise ValueError("fit_degrees needs measured bins at a degree above 1")
    scale, fixed = dict(machine.compute_scale), dict(machine.layer_s)
    for k, xy in points.items():
        slope, intercept = _line(xy)
        if slope < 1.0:
            slope = 1.0
            intercept = sum(y - x for x, y in xy) / len(xy)
        if intercept < 0:
            intercept, slope = 0.0, max(sum(x * y for x, y in xy) / sum(x * x for x, _ in xy), 1.0)
        scale[k], fixed[k] = slope, intercept / shapes.layers
    return replace(machine, compute_scale=tuple(sorted(scale.items())), layer_s=tuple(sorted(fixed.items())))


def _line(xy: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ``y = slope * x + intercept`` (slope 1 for one x)."""
    xs, ys = [x for x, _ in xy], [y for _, y in xy]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 1.0, my - mx
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return slope, my - slope * mx
