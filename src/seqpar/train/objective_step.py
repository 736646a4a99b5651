"""The one way ``seqpar train`` takes a loss: the run's objective (:mod:`.objectives`) through the seam
(:mod:`seqpar.objectives`), in the static step, in a dynamic schedule's bins and in evaluation::

    n      = step.count(micro-batches)              the step's units over every dp rank
    local  = seqpar.shard_batch(batch, mesh)        this SP rank's slice (or a bin's, from DynamicSP; the
                                                    whole batch for a DiT, which splits it itself)
    loss   = step.loss(local, n)                    objective(policy, local, mesh, reference=...,
                                                    num_units=n): this rank's share of the step's mean
    step.evaluate(data)                             the held-out units: the mean loss and the accuracy

The step's metrics are the unit-weighted means of its batches' over every rank of the job.
The vocabulary runs in tiles of --loss-tile tokens (--no-tiled-loss: one tile per shard, the whole
``[S_local, V]`` logits at once, as the model's own head).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

import seqpar
from seqpar.comm import collectives, faults
from seqpar.comm.mesh import axis_group
from seqpar.objectives import KTOKL

from .context import RunContext
from .objectives import DATA_KINDS, objective_of, units_in
from .report import EvalResult
from .sources import EVAL, MODEL_KEYS, DataSource, stack


class ObjectiveStep:
    """The run's objective bound to its :class:`~.context.RunContext`: the loss of a sharded batch, the
    step's unit count and metrics, and the held-out evaluation (see the module doc)."""

    def __init__(self, ctx: RunContext) -> None:
        cfg = ctx.job.cfg
        self.ctx = ctx
        self.spec = objective_of(cfg.objective)
        self.objective = self.spec.make(cfg)
        self.evaluation = self.spec.evaluator(cfg)
        self.tile = cfg.loss_tile if cfg.tiled_loss else 1 << 62  # off: the whole shard in one tile
        self.model_splits = DATA_KINDS[self.spec.data].model_splits  # a DiT: whole inputs on every sp rank
        self.metrics: dict[str, float] = {}  # the objective's metrics of the last step: over its every unit
        # [units, each metric times its units] of this rank's batches so far, each divided by the ranks that
        # hold the same batch (its SP group, or its bin's block): the sum over the job counts each batch once
        self._sums = torch.zeros(1 + len(self.objective.metric_names), dtype=torch.float64, device=ctx.device)

    def units(self, batch: dict[str, Tensor]) -> float:
        """The units of a whole (unsharded) batch: its targets, sequences or pairs (KL rows not counted)."""
        return units_in(self.split(batch)[0], self.objective.unit)

    def split(self, batch: dict[str, Tensor]
              ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor] | None]:
        """``(the model's batch, the objective's inputs, the KL rows or None)`` of a whole batch. The
        columns the objective reads go to it: per token ``[B, S]`` aligned with the labels (RL
        rollouts' advantages and log-probs; reference log-probs only where it takes a reference), per
        sequence ``[N]`` read at each sequence's first token (KTO's labels). With ``kl_rows`` (KTO) every
        unit's second row is its KL row, set apart."""
        kl = None
        if self.spec.kl_rows:  # units [2, S] stacked: row 2i the unit's row, row 2i + 1 its KL row
            kl = {k: v[1::2] for k, v in batch.items() if k in MODEL_KEYS}
            batch = {k: v[0::2] for k, v in batch.items()}
        needs = self.objective.needs
        names = {*needs.per_row, *needs.per_token, *needs.optional, *needs.per_pair, "ref_logps"}
        model_batch = {k: v for k, v in batch.items() if k not in names}
        inputs = {k: v for k, v in batch.items() if k in names and (k != "ref_logps" or needs.reference)}
        if needs.per_row:
            pos, mask = batch["position_ids"], batch.get("attention_mask")
            starts = (pos == 0) if mask is None else (pos == 0) & (mask > 0)  # [B, S]: each sequence once
            inputs.update({k: inputs[k][starts] for k in needs.per_row if k in inputs})  # [N], in order
        return model_batch, inputs, kl

    @torch.no_grad()
    def kl_estimate(self, kl_rows: dict[str, Tensor]) -> Tensor:
        """KTO's KL term of a micro-batch: the policy's minus the reference's summed log-prob over its KL
        rows, the mean over the rows (:class:`~seqpar.objectives.KTOKL`), then over the dp ranks, clamped
        at 0 -- as TRL gathers it. The same on every rank."""
        ctx = self.ctx
        local = seqpar.shard_batch(kl_rows, ctx.mesh, layout=ctx.job.layout)
        kl = KTOKL()(ctx.policy, local, ctx.mesh, reference=ctx.reference, tile=self.tile).metrics["kl"]
        kl = kl.reshape(1).to(torch.float64)
        if ctx.job.dp > 1:
            collectives.all_reduce(kl, group=axis_group(ctx.mesh, "dp"))
            kl /= ctx.job.dp
        return kl.reshape(()).clamp(min=0)

    def count(self, batches: Sequence[dict[str, Tensor]]) -> float:
        """The step's units over every dp rank (one all-reduce over dp). Called once per step: it
        starts the step's metrics afresh."""
        self.begin_step()
        n = torch.tensor([sum(self.units(b) for b in batches)], dtype=torch.float64, device=self.ctx.device)
        if self.ctx.job.dp > 1:
            collectives.all_reduce(n, group=axis_group(self.ctx.mesh, "dp"))
        return float(n)

    def begin_step(self) -> None:
        """Start a step's metrics afresh."""
        self.metrics = {}
        self._sums.zero_()

    def finish_step(self, group: dist.ProcessGroup | None = None) -> None:
        """The step's metrics (:attr:`metrics`): the unit-weighted mean of its batches' over every rank of
        the job (``group``: a group of all of them, default the world), so over every unit of the step,
        whichever rank ran it. Collective (one all-reduce of ``1 + metrics`` numbers) when the objective
        has metrics; a rank with no batch adds zeros."""
        names = self.objective.metric_names
        if not names:
            return
        sums = self._sums.to(collectives.comm_device(group or dist.group.WORLD))
        collectives.all_reduce(sums, group=group)
        units, *totals = sums.tolist()
        self.metrics = {k: v / units for k, v in zip(names, totals, strict=True)} if units else {}

    def batch_loss(self, batch: dict[str, Tensor], n_units: float) -> Tensor:
        """A whole micro-batch's loss on this rank: sharded over the SP group, its share of the step's
        mean over ``n_units``; its metrics count in the step's."""
        model_batch, inputs, kl_rows = self.split(batch)
        if kl_rows is not None:
            inputs["kl"] = self.kl_estimate(kl_rows)
        local = self.local(model_batch)
        return self.loss(local, n_units, units=units_in(model_batch, self.objective.unit),
                         copies=self.ctx.job.batch_ranks, inputs=inputs)

    def local(self, model_batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """What the objective gets of a whole batch on this rank: its shard (:func:`seqpar.shard_batch`),
        or the whole batch where the model splits its sequences itself (a DiT: ``model_splits``)."""
        if self.model_splits:
            return model_batch
        return seqpar.shard_batch(model_batch, self.ctx.mesh, layout=self.ctx.job.layout)

    def loss(self, local: dict[str, Tensor], n_units: float, *, units: float = 0.0, copies: int = 1,
             inputs: dict[str, Tensor] | None = None) -> Tensor:
        """The loss of a sharded batch (a micro-batch, or a dynamic schedule's bin: sharded over its
        block, the seam reduces over that block): its share of the step's mean over ``n_units``
        (0: the batch's own mean). ``units``: its units, whose metrics count in the step's (0: none, as
        an FSDP flush row's); ``copies``: the ranks it is sharded over (each holds the same metrics);
        ``inputs``: the objective's inputs of the whole batch (:meth:`split`)."""
        ctx, inputs = self.ctx, inputs or {}
        reference = None if "ref_logps" in inputs else ctx.reference  # the rollouts' own, where given
        out = self.objective(ctx.policy, local, ctx.mesh, reference=reference, num_units=n_units or None,
                             tile=self.tile, **inputs)
        names = self.objective.metric_names
        if names and units:
            assert set(out.metrics) == set(names), (sorted(out.metrics), names)  # metric_names is declared
            row = torch.stack([torch.ones((), dtype=torch.float64, device=self._sums.device),
                               *(out.metrics[k].to(self._sums) for k in names)])
            self._sums += row * (units / copies)
        return out.loss

    @torch.no_grad()
    def evaluate(self, data: DataSource) -> EvalResult | None:
        """The held-out units, split over the dp ranks: the objective's mean loss per unit and its
        accuracy (:attr:`TrainObjective.accuracy`: the greedy accuracy over the targets for sft, the
        preference accuracy for pairs), over every held-out unit; None without any."""
        ctx = self.ctx
        n = data.n_eval
        if n == 0:
            return None
        ctx.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, accuracy sum, units
        mine = list(range(ctx.dp_rank, n, ctx.job.dp))
        for i in range(-(-n // ctx.job.dp)):  # every dp rank runs the same number of forwards
            idx = mine[i] if i < len(mine) else mine[0] if mine else 0
            batch = {k: v.to(ctx.device) for k, v in stack([data.row(idx, EVAL)]).items()}
            model_batch, inputs, kl_rows = self.split(batch)
            reference = None if "ref_logps" in inputs else ctx.reference
            with faults.publishing("the evaluation"):
                if kl_rows is not None:
                    inputs["kl"] = self.kl_estimate(kl_rows)
                local = self.local(model_batch)
                out = self.evaluation(ctx.policy, local, ctx.mesh, reference=reference, tile=self.tile, **inputs)
            units = torch.tensor(out.units, dtype=torch.float64, device=ctx.device)
            # the mean over the batch's units; an objective without an accuracy counts 0 hits
            accuracy = out.metrics[self.spec.accuracy] if self.spec.accuracy else torch.zeros_like(units)
            row = torch.stack([out.loss.detach().double() * units, accuracy.double() * units, units])
            if i < len(mine):  # else a padding round of a dp rank with fewer units
                totals += row.to(totals)
        ctx.model.train()
        collectives.all_reduce(totals)  # over every rank: divide the sp x tp copies out below
        loss_sum, hits, units = (x / ctx.job.batch_ranks for x in totals.tolist())
        accuracy = hits / max(units, 1) if self.spec.accuracy else None
        return EvalResult(loss=loss_sum / max(units, 1), accuracy=accuracy, targets=int(round(units)))
