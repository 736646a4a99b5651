"""Token-budget batches: a step holds as many rows as fit a token budget per rank, not a fixed row
count, and its grad-accum micro-steps are formed the same way. Pure functions, no communication.

Rows are taken in their order (a stream: rows ``0, 1, 2, ...``). A micro-step closes when the next
row would take its tokens past ``world * token_budget`` (the budget of every rank together); a
step is ``micro_steps`` consecutive micro-steps::

    lengths   300 200 500 100 400 | 700 200 | ...      world=2, token_budget=500 (1000 a micro-step)
    micro     [0 1 2]  [3 4]      | [5 6]   | ...      micro_steps=2: step 0 = micro 0, 1

Within a micro-step the dynamic schedule (:mod:`seqpar.planner.schedule`) places the rows on the
ranks (each row at the smallest SP degree whose shard fits ``token_budget``): the total fits the
budget on average per rank, and LPT balances the ranks' predicted work.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetStep:
    """One optimizer step: its micro-steps, each a tuple of row indices (in stream order)."""

    micro: tuple[tuple[int, ...], ...]
    tokens: int  # the step's tokens, all micro-steps

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(i for m in self.micro for i in m)


def micro_batches(lengths: Iterable[int], *, world: int, token_budget: int, max_row: int | None = None
                  ) -> Iterator[tuple[int, ...]]:
    """Consecutive rows grouped into micro-steps of at most ``world * token_budget`` tokens (rows
    of ``lengths``, an iterable that may be endless). ``max_row``: the most tokens one row may have
    (default the micro-step's capacity; a dynamic schedule runs a row on at most ``sp`` ranks, so
    ``sp * token_budget``). Raises ValueError naming ``token_budget`` for a longer row."""
    return (rows for rows, _ in _micro(lengths, world, token_budget, max_row))


def _micro(lengths: Iterable[int], world: int, token_budget: int, max_row: int | None
           ) -> Iterator[tuple[tuple[int, ...], int]]:
    """``(row indices, tokens)`` of each micro-step (see :func:`micro_batches`)."""
    for name, v in (("world", world), ("token_budget", token_budget)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    capacity = world * token_budget
    limit = capacity if max_row is None else min(max_row, capacity)

    def checked() -> Iterator[int]:  # lazily: the stream may be endless
        for i, n in enumerate(lengths):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"row {i}: a row's length must be a positive integer, got {n!r}")
            if n > limit:
                raise ValueError(f"row {i} has {n} tokens, more than one row may take ({limit}) at token_budget="
                                 f"{token_budget} per rank: raise the token budget (--token-budget) to >= "
                                 f"{-(-n * token_budget // limit)}")
            yield n

    return _grouped(checked(), capacity)


def _grouped(lengths: Iterable[int], capacity: int) -> Iterator[tuple[tuple[int, ...], int]]:
    """``(row indices, tokens)`` of consecutive rows in groups of at most ``capacity`` tokens; a
    longer row is a group of its own."""
    rows: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if rows and used + n > capacity:
            yield tuple(rows), used
            rows, used = [], 0
        rows.append(i)
        used += n
    if rows:
        yield tuple(rows), used


def steps_by_tokens(lengths: Iterable[int], tokens_per_step: int) -> list[list[int]]:
    """Consecutive rows grouped into steps of at most ``tokens_per_step`` tokens (a longer row is a
    step of its own): token-budget steps instead of a fixed row count, unchecked (what
    :func:`seqpar.planner.gain.predict_gain` steps a length distribution by; a row too long for the
    schedule is the schedule's error). Raises ValueError for ``tokens_per_step`` < 1."""
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be a positive integer, got {tokens_per_step}")
    return [list(rows) for rows, _ in _grouped(lengths, tokens_per_step)]


def budget_steps(lengths: Iterable[int], *, world: int, token_budget: int, micro_steps: int = 1,
                 max_row: int | None = None) -> Iterator[BudgetStep]:
    """Optimizer steps of ``micro_steps`` token-budget micro-steps each (:func:`micro_batches`); a
    finite stream's last step may have fewer micro-steps. Raises ValueError as it does, and for
    ``micro_steps`` < 1."""
    if not isinstance(micro_steps, int) or isinstance(micro_steps, bool) or micro_steps < 1:
        raise ValueError(f"micro_steps must be a positive integer, got {micro_steps!r}")
    micro: list[tuple[int, ...]] = []
    tokens = 0
    for rows, n in _micro(lengths, world, token_budget, max_row):
        micro.append(rows)
        tokens += n
        if len(micro) == micro_steps:
            yield BudgetStep(tuple(micro), tokens)
            micro, tokens = [], 0
    if micro:
        yield BudgetStep(tuple(micro), tokens)
