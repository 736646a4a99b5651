"""What a dynamic SP schedule is predicted to gain over the static one on a length distribution:
the cost model's prediction over many steps, no measurement (``seqpar plan --lengths ...``).

Both schedules see the same rows in the same token-budget steps
(:func:`~seqpar.planner.batches.steps_by_tokens`); each step is planned twice with :func:`plan_step`,
once with every degree of the chain and once with the job's sp alone, and the predicted step times
are summed over the steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .batches import steps_by_tokens
from .schedule import Cost, plan_step


def lognormal_lengths(n: int, *, mean: float, sigma: float = 1.2, cap: int, seed: int, floor: int = 16) -> list[int]:
    """``n`` row lengths ~ lognormal with ``mean`` tokens before the cap (``mu = ln(mean) -
    sigma^2 / 2``), rounded and held in ``[floor, cap]``; the same for the same seed on any machine."""
    if n < 0 or mean <= 0 or sigma < 0 or not 1 <= floor <= cap:
        raise ValueError(f"lognormal lengths need n >= 0, mean > 0, sigma >= 0 and 1 <= floor <= cap; got "
                         f"n={n}, mean={mean}, sigma={sigma}, floor={floor}, cap={cap}")
    mu = math.log(mean) - sigma ** 2 / 2
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(mu + sigma * torch.randn(n, generator=g, dtype=torch.float64))
    return [int(min(max(floor, round(float(x))), cap)) for x in draws]


@dataclass(frozen=True)
class Gain:
    """Predicted seconds of ``steps`` steps under each schedule, and where the dynamic one ran the rows."""

    steps: int
    rows: int
    tokens: int
    static_s: float
    dynamic_s: float
    rows_at_degree: dict[int, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Dynamic / static predicted time (below 1: the dynamic schedule is predicted faster)."""
        return self.dynamic_s / self.static_s if self.static_s else 1.0


def predict_gain(lengths: Sequence[int], *, world: int, sp: int, token_budget: int, tokens_per_step: int,
                 cost: Cost) -> Gain:
    """The dynamic schedule's predicted gain on rows of ``lengths`` (one document each), cut into
    steps of at most ``tokens_per_step`` tokens. Raises ValueError (naming the option) for a row
    longer than ``sp x token_budget`` or a bad size."""
    static_s = dynamic_s = 0.0
    hist: dict[int, int] = {}
    steps = steps_by_tokens(lengths, tokens_per_step)
    for step in steps:
        docs = [[lengths[i]] for i in step]
        dyn = plan_step(docs, world=world, sp=sp, token_budget=token_budget, cost=cost)
        static = plan_step(docs, world=world, sp=sp, token_budget=token_budget, cost=cost, degrees=(sp,))
        dynamic_s += dyn.predicted_step_s
        static_s += static.predicted_step_s
        for k, n in dyn.rows_at_degree.items():
            hist[k] = hist.get(k, 0) + n
    return Gain(len(steps), len(lengths), sum(lengths), static_s, dynamic_s, dict(sorted(hist.items())))
