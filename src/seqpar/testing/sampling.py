"""A cheap sample of a test grid that still meets every option value (``make test`` runs it at the
world sizes whose whole grid repeats another size's; ``make verify`` runs the rest)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import fields
from typing import Any, TypeVar

from .attention_parity import AttnCase

C = TypeVar("C")


def option_values(case: AttnCase) -> set[tuple[str, object]]:
    """The ``(option, value)`` pairs a case exercises: strategy, kernel, the strategy's options
    (layout, comm, ulysses degree), mask, spans, causal, window, softcap, chunk, sinks, v head dim,
    length and head counts."""
    values = {(name, getattr(case, name)) for name in ("strategy", "kernel", "mask", "spans", "causal", "seq")}
    values |= {(name, getattr(case, name) is not None) for name in ("window", "softcap", "chunk")}
    values |= {("sinks", case.sinks), ("v_head_dim", case.v_head_dim), ("heads", (case.heads, case.kv_heads))}
    return values | {(f"options.{k}", v) for k, v in case.options.items()}


def field_values(case: Any) -> set[tuple[str, Hashable]]:
    """The ``(field, value)`` pairs of a dataclass case (a :class:`~.model_parity.ModelCase`)."""
    return {(f.name, getattr(case, f.name)) for f in fields(case)}


def covering_sample(cases: list[C], every: int, values: Callable[[C], set] = option_values
                    ) -> tuple[list[C], list[C]]:
    """``(sample, rest)`` of a grid: every ``every``-th case, plus the first case of each option
    value (``values``: :func:`option_values` of an attention case) the stride skipped; ``rest`` is
    every other case, in grid order."""
    chosen = set(range(0, len(cases), every))
    met = set().union(*(values(cases[i]) for i in chosen)) if chosen else set()
    for i, case in enumerate(cases):
        if not values(case) <= met:
            chosen.add(i)
            met |= values(case)
    return ([c for i, c in enumerate(cases) if i in chosen], [c for i, c in enumerate(cases) if i not in chosen])


def split_problems(sample: list[C], rest: list[C], full: list[C], values: Callable[[C], set] = option_values
                   ) -> list[str]:
    """What is wrong with ``(sample, rest)`` as a split of ``full`` (empty: nothing): together they are
    the grid, once each, and the sample meets every value (``values``) the grid does."""
    out = []
    if sorted(map(repr, sample + rest)) != sorted(map(repr, full)):
        out.append(f"sample + rest ({len(sample)} + {len(rest)}) is not the grid ({len(full)} cases)")
    missing = set().union(*map(values, full)) - set().union(*map(values, sample))
    if missing:
        out.append(f"the sample misses {sorted(map(str, missing))[:5]}")
    return out
