"""A cheap sample of an attention grid that still meets every option value (``make test`` runs it at
the world sizes whose whole grid repeats another size's; ``make verify`` runs the rest)."""

from __future__ import annotations

from .attention_parity import AttnCase


def option_values(case: AttnCase) -> set[tuple[str, object]]:
    """The ``(option, value)`` pairs a case exercises: strategy, kernel, the strategy's options
    (layout, comm, ulysses degree), mask, spans, causal, window, softcap, chunk, sinks, v head dim,
    length and head counts."""
    values = {(name, getattr(case, name)) for name in ("strategy", "kernel", "mask", "spans", "causal", "seq")}
    values |= {(name, getattr(case, name) is not None) for name in ("window", "softcap", "chunk")}
    values |= {("sinks", case.sinks), ("v_head_dim", case.v_head_dim), ("heads", (case.heads, case.kv_heads))}
    return values | {(f"options.{k}", v) for k, v in case.options.items()}


def covering_sample(cases: list[AttnCase], every: int) -> tuple[list[AttnCase], list[AttnCase]]:
    """``(sample, rest)`` of a grid: every ``every``-th case, plus the first case of each option
    value (:func:`option_values`) the stride skipped; ``rest`` is every other case, in grid order."""
    chosen = set(range(0, len(cases), every))
    met = set().union(*(option_values(cases[i]) for i in chosen)) if chosen else set()
    for i, case in enumerate(cases):
        if not option_values(case) <= met:
            chosen.add(i)
            met |= option_values(case)
    return ([c for i, c in enumerate(cases) if i in chosen], [c for i, c in enumerate(cases) if i not in chosen])
