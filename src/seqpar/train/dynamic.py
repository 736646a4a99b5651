"""``seqpar train --sp-schedule dynamic``: each step's rows binned and each bin run at the SP degree
its longest row needs (:class:`seqpar.planner.bins.DynamicSP`), exact as the static schedule.

Per optimizer step, on every rank (every rank reads the same rows)::

    micro-steps   without --token-budget: the static schedule's rows (dp x micro_batch per micro-step)
                  with --token-budget N:  as many rows as fit N tokens per rank (planner.batches)
    N             targets of the whole step (every micro-step, every rank)
    for each micro-step: DynamicSP.plan(rows, num_items=N); for each of this rank's bins:
        objective.loss(local, N).backward()    its share of the step's mean (the objective seam)
    seqpar.sync_gradients (or FSDP2's reduce-scatter): the world average, every gradient that of the
                  unsharded model

Under FSDP2 (``--fsdp on``, and ``--dtype bfloat16``'s mixed precision, the static schedule's policy)
each micro-step's bins run through :meth:`StepBins.fsdp`: gradient sync held back until this rank's
last bin, then a flush pass every rank runs; the model is sharded with ``reshard_after_forward=False``
(:func:`seqpar.train.model_setup.fsdp_options`) so a bin's backward all-gathers nothing either.

A row's padding is dropped (a bin packs real tokens only), so short rows run at degree 1 on one
rank while other ranks run others, and a row of ``--seq-len`` tokens takes ``--sp`` ranks.

Preference objectives (dpo, simpo, reward) bin whole pairs: a unit of pairs (``[2, S]`` chosen and
rejected rows, or a --packing row) is one row of the plan, its pairs as documents c0 r0 c1 r1 ...
(:func:`as_row`). N is the step's pairs; each bin runs :meth:`ObjectiveStep.loss` with
``num_units=N``: the seam reduces the bin's sequence sums over the bin's block of ranks
(:func:`seqpar.batch.loss.bin_group`) and scales the gradient for the average over every rank (the
bin's ``grad_ranks``), so each pair weighs 1/N over bins, micro-steps and dp ranks, as in the static
schedule. Losses that couple a micro-batch's pairs are refused
(:func:`seqpar.train.checks.check_dynamic_objective`). The step's metrics weigh each bin by its
pairs over its ``degree`` ranks (:meth:`ObjectiveStep.finish_step`: one all-reduce over the job), so
they are the static schedule's. The degree histogram counts rows: a
unit of two padded rows counts 2. With --packing (sft) a packed row's documents are binned apart
(``DynamicSP(documents=True)``) and the histogram counts documents.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

from torch import Tensor

import seqpar
from seqpar.comm import faults
from seqpar.integrations.models import decoder_config
from seqpar.planner.batches import BudgetStep, budget_steps
from seqpar.planner.bins import DynamicSP, pack_rows, row_tokens
from seqpar.planner.calibrate import describe_machine, measure_machine
from seqpar.planner.model_cost import config_shapes, model_cost
from seqpar.planner.work import Machine

from .checks import unit_tokens
from .context import RunContext
from .objective_step import ObjectiveStep
from .sources import DataSource, row_index, rows_in


def as_row(unit: dict[str, Tensor]) -> dict[str, Tensor]:
    """A unit as one row a bin packs: a row as it is; a pair's two rows ``[2, S]`` (chosen, rejected)
    as one packed row of two documents, so a pair never splits over bins and keeps the order c, r."""
    ids = unit["input_ids"]
    if ids.dim() < 2 or ids.shape[0] == 1:
        return unit
    return pack_rows([{k: v[i] for k, v in unit.items()} for i in range(ids.shape[0])])


class DynamicSteps:
    """The steps of a ``seqpar train`` run under a dynamic schedule, and the degree histogram of
    the rows it ran (``rows_at_degree``: the whole run; ``last``: the latest step; a pair of padded
    rows counts 2, chosen and rejected, as "rows" says). Collective to build (the block groups)."""

    def __init__(self, ctx: RunContext, objective: ObjectiveStep, data: DataSource) -> None:
        cfg, job = ctx.job.cfg, ctx.job
        self.ctx, self.objective, self.data = ctx, objective, data
        budget = cfg.token_budget if cfg.token_budget is not None else -(-unit_tokens(cfg) // job.sp)
        text_config = decoder_config(ctx.model.config)[0]
        dtype_bytes = next(ctx.model.parameters()).element_size()
        self.machine: Machine | None = None  # --cost-model measure: what was measured, and in how many seconds
        self.measure_s = 0.0
        if cfg.cost_model == "measure":
            t0 = time.perf_counter()
            with faults.publishing("measuring the cost model"):
                self.machine = measure_machine(ctx.model, ctx.mesh, config_shapes(text_config, dtype_bytes),
                                               token_budget=budget, loss_of=self._probe_loss, device=ctx.device)
            self.measure_s = time.perf_counter() - t0
        cost = model_cost(text_config, strategy=job.strategy, device_type=ctx.device.type, dtype_bytes=dtype_bytes,
                          machine=self.machine)
        # --packing: a packed row's documents are binned apart where each is a unit of the loss (sft, no
        # per-unit metrics to attribute); pairs stay whole: a packed row of pairs is one unit (as_row keeps
        # a pair together)
        documents = cfg.packing and objective.spec.data == "sequences" and not objective.spec.cls.metric_names
        self.dyn = DynamicSP(ctx.mesh, token_budget=budget, cost=cost, layout=job.layout, device=ctx.device,
                             documents=documents)
        self.unit = "documents" if self.dyn.documents else "rows"  # what the histogram counts
        self.token_budget = budget
        self.rows_at_degree: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.last_tokens = 0
        self._steps: list[BudgetStep] = []  # --token-budget: the steps formed so far (unit indices)
        self._stream: Iterator[BudgetStep] | None = None

    def _probe_loss(self, local: dict[str, Any]) -> Tensor:
        """A probe's or a flush row's loss: the objective's own mean over the row (no metrics)."""
        return self.objective.loss(local, 1.0)

    def micro_steps(self, step: int) -> list[list[dict[str, Any]]]:
        """The units of each micro-step of ``step`` (the same on every rank)."""
        cfg, job, data = self.ctx.job.cfg, self.ctx.job, self.data
        if cfg.token_budget is None:  # the static schedule's units, every dp rank's
            return [[data.row(row_index(step, m, d, b, grad_accum=cfg.grad_accum, dp=job.dp,
                                        micro_batch=cfg.micro_batch))
                     for d in range(job.dp) for b in range(cfg.micro_batch)] for m in range(cfg.grad_accum)]
        if self._stream is None:
            lengths = (int(row_tokens(as_row(data.row(i)))[0].numel()) for i in itertools.count())
            self._stream = budget_steps(lengths, world=job.world, token_budget=self.token_budget,
                                        micro_steps=cfg.grad_accum, max_row=job.sp * self.token_budget)
        while len(self._steps) <= step:
            self._steps.append(next(self._stream))
        return [[data.row(i) for i in m] for m in self._steps[step].micro]

    def forward_backward(self, step: int) -> tuple[float, int]:
        """Gradients of ``step``'s mean loss over its units (complete and exact after this: the world
        average). Returns ``(the loss on dp rank 0, else 0.0; the step's units)``, as the static
        :meth:`seqpar.train.step.StaticSteps.forward_backward` does."""
        ctx, objective = self.ctx, self.objective
        micro = self.micro_steps(step)
        objective.begin_step()
        n = sum(objective.units(u) for units in micro for u in units)  # every rank reads every unit
        loss_sum, hist, tokens = 0.0, {}, 0
        for units in micro:
            plan = self.dyn.plan([as_row(u) for u in units], num_items=n)
            # FSDP2: the reduce-scatter after this micro-step's last bin, in a flush pass every rank runs
            # (ranks run different numbers of bins); so each micro-step ends with every rank in step
            # before the next one's plan (a collective) -- one reduce-scatter per micro-step, not per step
            bins = plan.fsdp(ctx.model, self._probe_loss) if ctx.use_fsdp else plan
            # the bins first: zip must drive StepBins.fsdp past the last bin, to its flush pass
            for local, b in zip(bins, plan.mine, strict=True):
                # its metrics weigh its units, held alike by its block's b.degree ranks (documents: no metrics)
                bin_units = 0.0 if self.dyn.documents else sum(objective.units(units[i]) for i in b.rows)
                loss = objective.loss(local, n, units=bin_units, copies=b.degree)
                with faults.publishing("the backward"):  # an exception here is told to every rank
                    loss.backward()
                plan.record(loss)
            loss_sum += float(plan.loss())
            tokens += sum(b.tokens for b in plan.schedule.bins)
            for b in plan.schedule.bins:  # rows, not units: a pair's chosen and rejected rows count 2
                count = len(b.rows) if self.dyn.documents else sum(rows_in(units[i]) for i in b.rows)
                hist[b.degree] = hist.get(b.degree, 0) + count
        if not ctx.use_fsdp:
            seqpar.sync_gradients(ctx.model, ctx.mesh)
        objective.finish_step(self.dyn.degrees.all_group)  # over every unit of the step, every rank's bins
        self.last, self.last_tokens = dict(sorted(hist.items())), tokens
        for k, count in hist.items():
            self.rows_at_degree[k] = self.rows_at_degree.get(k, 0) + count
        self.rows_at_degree = dict(sorted(self.rows_at_degree.items()))
        return (loss_sum if ctx.dp_rank == 0 else 0.0), int(n)

    def describe_cost(self) -> str:
        """The cost model in words: ``"measured in 4.1 s: matmuls ..."`` or ``"builtin (cpu)"``."""
        if self.machine is None:
            return f"builtin ({self.ctx.device.type})"
        return f"measured in {self.measure_s:.1f} s: {describe_machine(self.machine)}"

    def describe_last(self) -> str:
        """The progress line's part: ``"rows at sp=1/2/4: 9/3/1"``."""
        return describe_degrees(self.last, self.unit)


def describe_degrees(hist: dict[int, int], unit: str = "rows") -> str:
    """``"rows at sp=1/2/4: 9/3/1"`` (``unit``: what the histogram counts; "" for an empty histogram)."""
    if not hist:
        return ""
    return f"{unit} at sp={'/'.join(map(str, hist))}: {'/'.join(map(str, hist.values()))}"
