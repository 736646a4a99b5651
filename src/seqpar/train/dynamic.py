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

Preference objectives (dpo, simpo, reward) bin whole pairs: a unit of pairs (``[2, S]`` chosen and
rejected rows, or a --packing row) is one row of the plan, its pairs as documents c0 r0 c1 r1 ...
(:func:`as_row`). N is the step's pairs; each bin runs :meth:`ObjectiveStep.pair_loss` with
``num_units=N``: the seam reduces the bin's sequence sums over the bin's block of ranks
(:func:`seqpar.batch.loss.bin_group`) and scales the gradient for the average over every rank (the
bin's ``grad_ranks``), so each pair weighs 1/N over bins, micro-steps and dp ranks, as in the static
schedule. Losses that couple a micro-batch's pairs are refused (:func:`check_objective`). The step's
metrics weigh each bin by its pairs over its ``degree`` ranks (:meth:`ObjectiveStep.finish_step`: one
all-reduce over the job), so they are the static schedule's. The degree histogram counts rows: a
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
from seqpar.attention.dispatch import ONE_AXIS
from seqpar.comm import faults
from seqpar.integrations.models import decoder_config
from seqpar.integrations.trl.dynamic import BATCH_COUPLED
from seqpar.planner.batches import BudgetStep, budget_steps
from seqpar.planner.bins import SP_SCHEDULES, DynamicSP, pack_rows, row_tokens, step_targets
from seqpar.planner.calibrate import MIN_MEASURED_BUDGET, describe_machine, measure_machine
from seqpar.planner.model_cost import config_shapes, model_cost
from seqpar.planner.work import Machine

from .config import PAIRED, TrainConfig, dpo_losses
from .data import row_index
from .preference_data import pairs_in


def check_schedule(cfg: TrainConfig, sp: int) -> None:
    """--sp-schedule and --token-budget against the other options (pure). Raises ValueError naming
    the option to change."""
    if cfg.sp_schedule not in SP_SCHEDULES:
        raise ValueError(f"unknown --sp-schedule {cfg.sp_schedule!r}: choose one of {list(SP_SCHEDULES)}")
    if cfg.sp_schedule == "static":
        if cfg.token_budget is not None:
            raise ValueError("--token-budget forms the steps of a dynamic schedule: give --sp-schedule dynamic too")
        if cfg.cost_model != "measure":
            raise ValueError("--cost-model chooses a dynamic schedule's cost model: give --sp-schedule dynamic too")
        return
    check_objective(cfg)
    budget = cfg.token_budget if cfg.token_budget is not None else -(-unit_tokens(cfg) // sp)
    if cfg.cost_model == "measure" and budget < MIN_MEASURED_BUDGET:
        raise ValueError(f"--cost-model measure times bins of up to 16 documents per rank, which {budget} tokens per "
                         f"rank (--token-budget, or --seq-len / --sp) cannot hold: use --cost-model builtin or a "
                         f"budget of >= {MIN_MEASURED_BUDGET}")
    if cfg.strategy not in ONE_AXIS:
        raise ValueError(f"--sp-schedule dynamic runs bins at degrees below --sp on sub-groups of ranks, which "
                         f"--strategy {cfg.strategy} has none of: use --strategy {' or '.join(ONE_AXIS)}")
    if cfg.token_budget is not None:
        if cfg.token_budget < 1:
            raise ValueError(f"--token-budget must be >= 1, got {cfg.token_budget}")
        if cfg.micro_batch != 1:
            raise ValueError("--token-budget sets how many rows a step holds, in place of --micro-batch: leave "
                             "--micro-batch at 1")
        need = -(-unit_tokens(cfg) // sp)
        if cfg.token_budget < need:
            what = f"a row of --seq-len {cfg.seq_len}" if unit_tokens(cfg) == cfg.seq_len else \
                f"a pair of two rows of --seq-len {cfg.seq_len}"
            raise ValueError(f"--token-budget {cfg.token_budget} cannot hold {what} on --sp {sp} ranks: use "
                             f"--token-budget >= {need}")


def check_objective(cfg: TrainConfig) -> None:
    """--objective under --sp-schedule dynamic (pure): a bin holds whole pairs, and the loss is a sum
    of per-pair terms over the step's pairs, so it is exact when each pair's term depends on that pair
    alone. Raises ValueError naming the option for an objective whose loss couples a batch's pairs."""
    if cfg.objective == "orpo":
        raise ValueError("--objective orpo's NLL term is a token mean over a micro-batch's chosen completions, "
                         "which a dynamic schedule's bins (other pairs than the micro-batch's) would change: use "
                         "--sp-schedule static (dpo, simpo and reward run under dynamic)")
    if cfg.objective == "dpo":
        coupled = [t for t in dpo_losses(cfg) if t in BATCH_COUPLED]
        if coupled:
            raise ValueError(f"--dpo-loss {coupled[0]} {BATCH_COUPLED[coupled[0]]}, which a dynamic schedule's bins "
                             f"(other pairs than the micro-batch's) would change: use --sp-schedule static or "
                             f"another --dpo-loss (not {', '.join(BATCH_COUPLED)})")


def unit_tokens(cfg: TrainConfig) -> int:
    """The most real tokens of one unit of the data order: a row of --seq-len, or a pair of two such
    rows (preference data without --packing: chosen and rejected, one bin holds both)."""
    return 2 * cfg.seq_len if cfg.objective in PAIRED and not cfg.packing else cfg.seq_len


def rows_in(unit: dict[str, Tensor]) -> int:
    """The rows a unit holds: 2 for a pair of padded rows ``[2, S]`` (chosen, rejected), else 1."""
    ids = unit["input_ids"]
    return ids.shape[0] if ids.dim() == 2 else 1


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
    rows counts 2, chosen and rejected, as "rows" says)."""

    def __init__(self, trainer: Any) -> None:
        cfg, job = trainer.cfg, trainer.job
        self.trainer = trainer
        self.paired = cfg.objective in PAIRED
        budget = cfg.token_budget if cfg.token_budget is not None else -(-unit_tokens(cfg) // job.sp)
        text_config = decoder_config(trainer.model.config)[0]
        dtype_bytes = next(trainer.model.parameters()).element_size()
        self.machine: Machine | None = None  # --cost-model measure: what was measured, and in how many seconds
        self.measure_s = 0.0
        if cfg.cost_model == "measure":
            t0 = time.perf_counter()
            loss_of = (lambda local: trainer.objective.pair_loss(local, 1.0)[0]) if self.paired else None
            with faults.publishing("measuring the cost model"):
                self.machine = measure_machine(trainer.model, trainer.mesh, config_shapes(text_config, dtype_bytes),
                                               token_budget=budget, loss_of=loss_of, device=trainer.device)
            self.measure_s = time.perf_counter() - t0
        cost = model_cost(text_config, strategy=job.strategy, device_type=trainer.device.type, dtype_bytes=dtype_bytes,
                          machine=self.machine)
        # --packing: a packed row's documents are binned apart (a pair's two stay one unit: paired objectives
        # pack whole pairs, which as_row keeps together)
        self.dyn = DynamicSP(trainer.mesh, token_budget=budget, cost=cost, layout=job.layout, device=trainer.device,
                             documents=cfg.packing and not self.paired)
        self.unit = "documents" if self.dyn.documents else "rows"  # what the histogram counts
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
            lengths = (int(row_tokens(as_row(data.row(i)))[0].numel()) for i in itertools.count())
            self._stream = budget_steps(lengths, world=job.world, token_budget=self.token_budget,
                                        micro_steps=cfg.grad_accum, max_row=job.sp * self.token_budget)
        while len(self._steps) <= step:
            self._steps.append(next(self._stream))
        return [[data.row(i) for i in m] for m in self._steps[step].micro]

    def forward_backward(self, step: int) -> tuple[float, int]:
        """Gradients of ``step``'s mean loss over its targets, or its pairs (complete and exact after
        this: the world average). Returns ``(the loss on dp rank 0, else 0.0; the step's units)``, as
        the static :meth:`seqpar.train.loop.Trainer.forward_backward` does."""
        t = self.trainer
        micro = self.micro_steps(step)
        if self.paired:  # the mean over the step's pairs; each bin holds whole pairs
            n = float(sum(pairs_in(u) for rows in micro for u in rows))
            t.objective.begin_step()
        else:
            n = sum(step_targets(rows) for rows in micro)
        loss_sum, hist, tokens = 0.0, {}, 0
        for units in micro:
            rows = [as_row(u) for u in units] if self.paired else units
            plan = self.dyn.plan(rows, num_items=n)
            # FSDP2: the reduce-scatter after this micro-step's last bin, in a flush pass every rank runs
            # (ranks run different numbers of bins); so each micro-step ends with every rank in step
            # before the next one's plan (a collective) -- one reduce-scatter per micro-step, not per step
            flush = (lambda local: t.objective.pair_loss(local, 1.0)[0]) if self.paired else None
            # the bins first: zip must drive StepBins.fsdp past the last bin, to its flush pass
            for local, b in zip(plan.fsdp(t.model, flush) if t.use_fsdp else plan, plan.mine, strict=True):
                if self.paired:  # the bin's metrics weigh its pairs, held alike by its block's b.degree ranks
                    pairs = sum(pairs_in(units[i]) for i in b.rows)
                    loss = t.objective.pair_loss(local, n, units=pairs, copies=b.degree)[0]
                else:
                    loss = t.model(**local).loss
                with faults.publishing("the backward"):  # an exception here is told to every rank
                    loss.backward()
                plan.record(loss)
            loss_sum += float(plan.loss())
            tokens += sum(b.tokens for b in plan.schedule.bins)
            for b in plan.schedule.bins:  # rows, not units: a pair's chosen and rejected rows count 2
                count = sum(rows_in(units[i]) for i in b.rows) if self.paired else len(b.rows)  # rows or documents
                hist[b.degree] = hist.get(b.degree, 0) + count
        if not t.use_fsdp:
            seqpar.sync_gradients(t.model, t.mesh)
        if self.paired:  # over every pair of the step, every rank's bins (one all-reduce over the job)
            t.objective.finish_step(self.dyn.degrees.all_group)
        self.last, self.last_tokens = dict(sorted(hist.items())), tokens
        for k, count in hist.items():
            self.rows_at_degree[k] = self.rows_at_degree.get(k, 0) + count
        self.rows_at_degree = dict(sorted(self.rows_at_degree.items()))
        return (loss_sum if t.dp_rank == 0 else 0.0), int(n)

    def describe_cost(self) -> str:
        """The cost model in words: ``"measured in 4.1 s: matmuls ..."`` or ``"builtin (cpu)"``."""
        if self.machine is None:
            return f"builtin ({self.trainer.device.type})"
        return f"measured in {self.measure_s:.1f} s: {describe_machine(self.machine)}"

    def describe_last(self) -> str:
        """The progress line's part: ``"rows at sp=1/2/4: 9/3/1"``."""
        return describe_degrees(self.last, self.unit)


def describe_degrees(hist: dict[int, int], unit: str = "rows") -> str:
    """``"rows at sp=1/2/4: 9/3/1"`` (``unit``: what the histogram counts; "" for an empty histogram)."""
    if not hist:
        return ""
    return f"{unit} at sp={'/'.join(map(str, hist))}: {'/'.join(map(str, hist.values()))}"


def dynamic_steps(trainer: Any) -> DynamicSteps | None:
    """The run's :class:`DynamicSteps` (collective: builds the block groups), or None for a static
    schedule."""
    if trainer.cfg.sp_schedule != "dynamic":
        return None
    return DynamicSteps(trainer)

