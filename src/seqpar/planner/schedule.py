"""A dynamic SP schedule for one optimizer step: which rows run together (bins), at which SP
degree, on which ranks. Pure functions, no communication.

Ranks ``0..W-1`` are cut into aligned blocks of ``k`` consecutive ranks for every degree ``k`` of
the chain ``1, 2, 4, ..., sp`` (each divides the next, so a block of ``k`` lies inside one block of
``2k``, and inside one sp group of the job's ``dp x sp`` mesh)::

    degree 4   [ 0  1  2  3 ] [ 4  5  6  7 ]
    degree 2   [ 0  1 ][ 2  3 ] [ 4  5 ][ 6  7 ]
    degree 1   [0][1][2][3] ...

1. Each row needs the smallest degree whose shard fits the per-rank ``token_budget``
   (``ceil(tokens / k) <= budget``); rows of one degree are packed into bins of at most
   ``k * budget`` tokens, first-fit by decreasing length.
2. Bins are placed by greedy LPT: longest predicted first, on the block whose busiest rank is
   least loaded. A bin on the busiest rank is then raised to the next degree while that lowers the
   predicted step time (the cost model: :mod:`seqpar.planner.work`).
3. If the static schedule (every bin at sp, :func:`plan_step` with ``degrees=(sp,)``) is predicted
   no slower, it is the step's schedule: a dynamic schedule is never predicted slower than static.
4. Ranks run their bins by degree, largest first (then in placement order): every rank of a block
   went through the same larger blocks, so no rank waits on a peer that waits on another, and a
   rank's predicted time is the sum of its bins' predictions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..comm.degrees import degree_chain

Cost = Callable[[Sequence[int], int], float]
"""``cost(documents' token counts, degree) -> predicted seconds per rank`` of one bin."""


@dataclass(frozen=True)
class Bin:
    """Rows run together as one packed row over ranks ``first_rank .. first_rank + degree - 1``."""

    degree: int
    first_rank: int
    rows: tuple[int, ...]  # indices into the step's rows, in packing order
    tokens: int
    predicted_s: float

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.degree)


@dataclass(frozen=True)
class Schedule:
    """One step's bins in execution order, and what the cost model predicted per rank."""

    world: int
    sp: int
    token_budget: int
    bins: tuple[Bin, ...]
    predicted_rank_s: tuple[float, ...]
    rows_at_degree: dict[int, int] = field(default_factory=dict)

    @property
    def predicted_step_s(self) -> float:
        return max(self.predicted_rank_s, default=0.0)

    def bins_for(self, rank: int) -> list[Bin]:
        """The bins ``rank`` runs, in the order it must run them."""
        return [b for b in self.bins if rank in b.ranks]

    def describe(self) -> str:
        """``"rows at sp=1: 12, sp=2: 3, sp=4: 1; predicted 0.84 s (ranks 0.80-0.84 s)"``."""
        hist = ", ".join(f"sp={k}: {n}" for k, n in sorted(self.rows_at_degree.items()))
        lo = min(self.predicted_rank_s, default=0.0)
        return f"rows at {hist}; predicted {self.predicted_step_s:.3g} s (ranks {lo:.3g}-{self.predicted_step_s:.3g} s)"


def plan_step(docs: Sequence[Sequence[int]], *, world: int, sp: int, token_budget: int, cost: Cost,
              degrees: Sequence[int] | None = None, max_raises: int | None = None) -> Schedule:
    """The schedule of one step. ``docs[i]``: the token counts of row ``i``'s documents (one entry
    for a plain row). ``degrees``: the allowed degrees (default :func:`degree_chain`; ``(sp,)`` is
    the static schedule; ``max_raises=0``: every bin at its smallest degree). Raises ValueError naming
    ``token_budget`` for a row that fits no degree."""
    _check(docs, world=world, sp=sp, token_budget=token_budget)
    cost = _remembered(cost)  # the raise loop re-places every bin per trial: price each (bin, degree) once
    chain = tuple(degrees) if degrees is not None else degree_chain(sp)
    if any(k not in degree_chain(sp) for k in chain) or not chain:
        raise ValueError(f"degrees {list(chain)} must be taken from {list(degree_chain(sp))} (sp={sp})")
    chain = tuple(sorted(set(chain)))
    tokens = [sum(d) for d in docs]
    need = [_smallest_degree(t, chain, token_budget, i, sp) for i, t in enumerate(tokens)]
    groups = [list(b) for k in chain for b in _pack([i for i in range(len(docs)) if need[i] == k], tokens,
                                                    k * token_budget)]
    degree = [_fewer_than_tokens(need[g[0]], sum(tokens[i] for i in g), chain) for g in groups]
    best = _place(groups, degree, docs, world, cost)
    for _ in range(max_raises if max_raises is not None else 4 * len(groups) * len(chain)):
        busiest = max(range(world), key=lambda r: best[1][r])
        raised = None
        for gi, (k, first) in enumerate(best[0]):
            if not first <= busiest < first + k:
                continue
            for up in (c for c in chain if k < c <= sum(tokens[i] for i in groups[gi])):
                trial = degree.copy()
                trial[gi] = up
                placed = _place(groups, trial, docs, world, cost)
                if max(placed[1]) < max(best[1]) * (1 - 1e-9) and (raised is None or
                                                                  max(placed[1]) < max(raised[1][1])):
                    raised = (trial, placed)
        if raised is None:
            break
        degree, best = raised
    mixed = _schedule(groups, best, docs, world, sp, token_budget, cost)
    if chain[-1] != sp or chain == (sp,) or max_raises == 0 or all(k == sp for k in need):
        return mixed  # (every row needing sp: packed and placed as static already, no second plan)
    # the greedy can end above the static schedule (few bins that LPT cannot spread, each paying
    # its fixed cost): then the static schedule is this step's dynamic choice too
    static = plan_step(docs, world=world, sp=sp, token_budget=token_budget, cost=cost, degrees=(sp,))
    return static if static.predicted_step_s <= mixed.predicted_step_s else mixed


def _check(docs: Sequence[Sequence[int]], *, world: int, sp: int, token_budget: int) -> None:
    for name, v in (("world", world), ("sp", sp), ("token_budget", token_budget)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if world % sp:
        raise ValueError(f"sp={sp} must divide the world size {world}")
    for i, d in enumerate(docs):
        if not d or any(not isinstance(n, int) or n < 1 for n in d):
            raise ValueError(f"row {i}: document lengths must be positive integers, got {list(d)}")


def _remembered(cost: Cost) -> Cost:
    seen: dict[tuple[tuple[int, ...], int], float] = {}

    def cached(docs: Sequence[int], degree: int) -> float:
        key = (tuple(docs), degree)
        if key not in seen:
            seen[key] = cost(docs, degree)
        return seen[key]
    return cached


def _smallest_degree(tokens: int, chain: Sequence[int], budget: int, row: int, sp: int) -> int:
    for k in chain:
        if -(-tokens // k) <= budget:
            return k
    raise ValueError(f"row {row} has {tokens} tokens: more than sp={chain[-1]} ranks x token_budget={budget}; "
                     f"raise the token budget (--token-budget) to >= {-(-tokens // chain[-1])} or sp (<= {sp})")


def _fewer_than_tokens(k: int, tokens: int, chain: Sequence[int]) -> int:
    """``k``, or the largest allowed degree not above ``tokens`` (no rank may get an empty shard)."""
    if tokens >= k:
        return k
    fits = [c for c in chain if c <= tokens]
    if not fits:
        raise ValueError(f"a bin of {tokens} tokens cannot run at degree {k} or any allowed below it "
                         f"({list(chain)}): every rank needs a token; allow smaller degrees")
    return fits[-1]


def _pack(rows: list[int], tokens: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: bins of at most ``capacity`` tokens (a longer row gets its own)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(rows, key=lambda i: (-tokens[i], i)):
        j = next((j for j, r in enumerate(room) if tokens[i] <= r), None)
        if j is None:
            bins.append([i])
            room.append(capacity - tokens[i])
        else:
            bins[j].append(i)
            room[j] -= tokens[i]
    return bins


def _bin_docs(group: Sequence[int], docs: Sequence[Sequence[int]]) -> list[int]:
    return [n for i in group for n in docs[i]]


def _place(groups: list[list[int]], degree: list[int], docs: Sequence[Sequence[int]], world: int,
           cost: Cost) -> tuple[list[tuple[int, int]], list[float]]:
    """Greedy LPT: ``([(degree, first rank)] per bin, predicted seconds per rank)``."""
    times = [cost(_bin_docs(g, docs), k) for g, k in zip(groups, degree, strict=True)]
    load = [0.0] * world
    where: list[tuple[int, int]] = [(0, 0)] * len(groups)
    for gi in sorted(range(len(groups)), key=lambda gi: (-degree[gi], -times[gi], gi)):
        k = degree[gi]
        busiest = load if k == 1 else [max(load[f:f + k]) for f in range(0, world, k)]  # per block
        first = k * min(range(len(busiest)), key=busiest.__getitem__)  # the first of equals
        for r in range(first, first + k):
            load[r] += times[gi]
        where[gi] = (k, first)
    return where, load


def _schedule(groups: list[list[int]], placed: tuple[list[tuple[int, int]], list[float]],
              docs: Sequence[Sequence[int]], world: int, sp: int, token_budget: int, cost: Cost) -> Schedule:
    where, load = placed
    bins = [Bin(k, first, tuple(g), sum(sum(docs[i]) for i in g), cost(_bin_docs(g, docs), k))
            for g, (k, first) in zip(groups, where, strict=True)]
    bins.sort(key=lambda b: (-b.degree, -b.predicted_s, b.first_rank, b.rows))
    hist: dict[int, int] = {}
    for b in bins:
        hist[b.degree] = hist.get(b.degree, 0) + len(b.rows)
    return Schedule(world, sp, token_budget, tuple(bins), tuple(load), hist)

