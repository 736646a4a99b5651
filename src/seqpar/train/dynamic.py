"""``seqpar train --sp-schedule dynamic``: each step's rows binned and each bin run at the SP degree
its longest row needs (:class:`seqpar.planner.bins.DynamicSP`), exact as the static schedule.

Per optimizer step, on every rank (every rank reads the same rows)::

    micro-steps   without --token-budget: the static schedule's rows (dp x micro_batch per micro-step)
                  with --token-budget N:  as many rows as fit N tokens per rank (planner.batches)
    N             targets of the whole step (every micro-step, every rank)
    for each micro-step: DynamicSP.plan(rows, num_items=N); for each of this rank's bins:
        model(**local).loss.backward()         its share of the step's token mean
    seqpar.sync_gradients (or FSDP2's reduce-scatter): the world average, every gradient that of the
                  unsharded model

Under FSDP2 (``--fsdp on``, and ``--dtype bfloat16``'s mixed precision, the static schedule's policy)
each micro-step's bins run through :meth:`StepBins.fsdp`: gradient sync held back until this rank's
last bin, then a flush pass every rank runs; the model is sharded with ``reshard_after_forward=False``
(:func:`seqpar.train.loop.fsdp_options`) so a bin's backward all-gathers nothing either.

A row's padding is dropped (a bin packs real tokens only), so short rows run at degree 1 on one
rank while other ranks run others, and a row of ``--seq-len`` tokens takes ``--sp`` ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import seqpar
from seqpar.comm import faults
from seqpar.integrations.models import decoder_config
from seqpar.planner.batches import BudgetStep, budget_steps
from seqpar.planner.bins import SP_SCHEDULES, DynamicSP, row_tokens, step_targets
from seqpar.planner.model_cost import model_cost

from .config import TrainConfig
from .data import row_index


def check_schedule(cfg: TrainConfig, sp: int) -> None:
    """--sp-schedule and --token-budget against the other options (pure). Raises ValueError naming
    the option to change."""
    if cfg.sp_schedule not in SP_SCHEDULES:
        raise ValueError(f"unknown --sp-schedule {cfg.sp_schedule!r}: choose one of {list(SP_SCHEDULES)}")
    if cfg.sp_schedule == "static":
        if cfg.token_budget is not None:
            raise ValueError("--token-budget forms the steps of a dynamic schedule: give --sp-schedule dynamic too")
        return
    if cfg.objective != "sft":
        raise ValueError(f"--sp-schedule dynamic bins rows for the token mean; --objective {cfg.objective} runs on "
                         "whole pairs: use --sp-schedule static (or --objective sft)")
    if cfg.strategy not in ("ulysses", "ring"):
        raise ValueError(f"--sp-schedule dynamic runs bins at degrees below --sp on sub-groups of ranks, which "
                         f"--strategy {cfg.strategy} has none of: use --strategy ulysses or ring")
    if cfg.token_budget is not None:
        if cfg.token_budget < 1:
            raise ValueError(f"--token-budget must be >= 1, got {cfg.token_budget}")
        if cfg.micro_batch != 1:
            raise ValueError("--token-budget sets how many rows a step holds, in place of --micro-batch: leave "
                             "--micro-batch at 1")
        need = -(-cfg.seq_len // sp)
        if cfg.token_budget < need:
            raise ValueError(f"--token-budget {cfg.token_budget} cannot hold a row of --seq-len {cfg.seq_len} on "
                             f"--sp {sp} ranks: use --token-budget >= {need}")


class DynamicSteps:
    """The steps of a ``seqpar train`` run under a dynamic schedule, and the degree histogram of
    the rows it ran (``rows_at_degree``: the whole run; ``last``: the latest step)."""

    def __init__(self, trainer: Any) -> None:
        cfg, job = trainer.cfg, trainer.job
        self.trainer = trainer
        budget = cfg.token_budget if cfg.token_budget is not None else -(-cfg.seq_len // job.sp)
        cost = model_cost(decoder_config(trainer.model.config)[0], strategy=job.strategy,
                          device_type=trainer.device.type, dtype_bytes=next(trainer.model.parameters()).element_size())
        self.dyn = DynamicSP(trainer.mesh, token_budget=budget, cost=cost, layout=job.layout, device=trainer.device)
        self.token_budget = budget
        self.rows_at_degree: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.last_tokens = 0
        self._steps: list[BudgetStep] = []  # --token-budget: the steps formed so far (row indices)
        self._stream: Iterator[BudgetStep] | None = None

    def micro_steps(self, step: int) -> list[list[dict[str, Any]]]:
        """The rows of each micro-step of ``step`` (the same on every rank)."""
        cfg, job, data = self.trainer.cfg, self.trainer.job, self.trainer.data
        if cfg.token_budget is None:  # the static schedule's rows, every dp rank's
            return [[data.row(row_index(step, m, d, b, grad_accum=cfg.grad_accum, dp=job.dp,
                                        micro_batch=cfg.micro_batch))
                     for d in range(job.dp) for b in range(cfg.micro_batch)] for m in range(cfg.grad_accum)]
        if self._stream is None:
            lengths = (int(row_tokens(data.row(i))[0].numel()) for i in itertools.count())
            self._stream = budget_steps(lengths, world=job.world, token_budget=self.token_budget,
                                        micro_steps=cfg.grad_accum, max_row=job.sp * self.token_budget)
        while len(self._steps) <= step:
            self._steps.append(next(self._stream))
        return [[data.row(i) for i in m] for m in self._steps[step].micro]

    def forward_backward(self, step: int) -> tuple[float, int]:
        """Gradients of ``step``'s token-mean loss (complete and exact after this: the world
        average). Returns ``(the loss on dp rank 0, else 0.0; the step's targets)``, as the static
        :meth:`seqpar.train.loop.Trainer.forward_backward` does."""
        t = self.trainer
        micro = self.micro_steps(step)
        n = sum(step_targets(rows) for rows in micro)
        loss_sum, hist, tokens = 0.0, {}, 0
        for rows in micro:
            plan = self.dyn.plan(rows, num_items=n)
            # FSDP2: the reduce-scatter after this micro-step's last bin, in a flush pass every rank runs
            # (ranks run different numbers of bins); so each micro-step ends with every rank in step
            # before the next one's plan (a collective) -- one reduce-scatter per micro-step, not per step
            for local in plan.fsdp(t.model) if t.use_fsdp else plan:
                loss = t.model(**local).loss
                with faults.publishing("the backward"):  # an exception here is told to every rank
                    loss.backward()
                plan.record(loss)
            loss_sum += float(plan.loss())
            tokens += sum(b.tokens for b in plan.schedule.bins)
            for k, count in plan.schedule.rows_at_degree.items():
                hist[k] = hist.get(k, 0) + count
        if not t.use_fsdp:
            seqpar.sync_gradients(t.model, t.mesh)
        self.last, self.last_tokens = dict(sorted(hist.items())), tokens
        for k, count in hist.items():
            self.rows_at_degree[k] = self.rows_at_degree.get(k, 0) + count
        self.rows_at_degree = dict(sorted(self.rows_at_degree.items()))
        return (loss_sum if t.dp_rank == 0 else 0.0), int(n)

    def describe_last(self) -> str:
        """The progress line's part: ``"rows at sp=1/2/4: 9/3/1"``."""
        return describe_degrees(self.last)


def describe_degrees(hist: dict[int, int]) -> str:
    """``"rows at sp=1/2/4: 9/3/1"`` ("" for an empty histogram)."""
    if not hist:
        return ""
    return f"rows at sp={'/'.join(map(str, hist))}: {'/'.join(map(str, hist.values()))}"


def dynamic_steps(trainer: Any) -> DynamicSteps | None:
    """The run's :class:`DynamicSteps` (collective: builds the block groups), or None for a static
    schedule."""
    if trainer.cfg.sp_schedule != "dynamic":
        return None
    return DynamicSteps(trainer)

