"""The training step of ``seqpar train``: the step's gradients, then the update.

Per optimizer step, on every rank (the static schedule; the dynamic one: :mod:`.dynamic`)::

    units     this dp rank's micro-batches (unit k = f(seed, step, micro, dp rank): resumable)
    N         the step's units, all dp ranks: targets (sft) or pairs (dpo, reward, ...): ObjectiveStep.count
    for each micro-batch:
      local = seqpar.shard_batch(batch, mesh)               this SP rank's slice
      objective(policy, local, mesh, num_units=N).backward()   exact share of the global mean over N
    seqpar.sync_gradients (or FSDP2's reduce-scatter): the dp x sp average, every grad now exact
    the global gradient norm (and the step's loss): NaN / Inf stops or skips the step (--on-nonfinite)
    clip to the global norm, AdamW, warmup + cosine                          (Optimization)

so the loss and gradients are those of one big batch on one device, whatever dp, sp, grad_accum.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

import seqpar
from seqpar.batch.grad_groups import total_grad_norm
from seqpar.comm import faults

from .config import TrainConfig
from .context import RunContext
from .objective_step import ObjectiveStep
from .sources import DataSource, row_index, stack


class StaticSteps:
    """The static schedule: every micro-batch of a dp rank sharded over its SP group."""

    def __init__(self, ctx: RunContext, objective: ObjectiveStep, data: DataSource) -> None:
        self.ctx, self.objective, self.data = ctx, objective, data

    def micro_batches(self, step: int) -> list[dict[str, Tensor]]:
        """This dp rank's micro-batches of ``step``, on the rank's device."""
        cfg, ctx = self.ctx.job.cfg, self.ctx
        out = []
        for m in range(cfg.grad_accum):
            units = [self.data.row(row_index(step, m, ctx.dp_rank, b, grad_accum=cfg.grad_accum, dp=ctx.job.dp,
                                             micro_batch=cfg.micro_batch)) for b in range(cfg.micro_batch)]
            out.append({k: v.to(ctx.device) for k, v in stack(units).items()})
        return out

    def forward_backward(self, step: int) -> tuple[float, int]:
        """Gradients of the global mean loss of ``step`` (over its units) on every rank (complete and
        exact after this: averaged over dp x sp). Returns ``(this dp rank's share of the loss, units)``."""
        ctx = self.ctx
        batches = self.micro_batches(step)
        n_units = self.objective.count(batches)
        share = 0.0
        for i, b in enumerate(batches):
            if ctx.use_fsdp:  # reduce-scatter once per step, after the last micro-batch, not after each
                ctx.model.set_requires_gradient_sync(i == len(batches) - 1)
            loss = self.objective.batch_loss(b, n_units)
            with faults.publishing("the backward"):  # an exception here is told to every rank
                loss.backward()
            share += float(loss.detach())
        if not ctx.use_fsdp:
            seqpar.sync_gradients(ctx.model, ctx.mesh)
        self.objective.finish_step()  # its metrics over every unit of the step (every dp rank's)
        return share, int(n_units)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warmup to 1 over ``warmup`` steps, then cosine down to ``min_lr_ratio``."""
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return f


class Optimization:
    """The update: the global gradient norm, clipping to it, AdamW over the trainable parameters and
    the learning-rate schedule; ``step`` counts the steps done."""

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module) -> None:
        self.cfg, self.model = cfg, model
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                           betas=(0.9, 0.95), weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.step = 0

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def grad_norm(self) -> tuple[Tensor, float]:
        """The global gradient norm (the same on every rank), as a float64 tensor and a number:
        :func:`seqpar.batch.grad_groups.total_grad_norm` -- after sync_gradients a replicated
        parameter's gradient is whole on every rank (counted once), an expert shard's squares are
        summed over the ranks that hold the others (--ep), a DTensor gradient's over the mesh
        dimensions it is sharded on (--tp's shards, FSDP2's)."""
        norm = total_grad_norm(self.model)
        return norm, float(norm)

    def apply(self, norm: tuple[Tensor, float] | None = None) -> float:
        """Clip to the global gradient norm (``norm``: :meth:`grad_norm`'s, computed if not given),
        step AdamW and the schedule; returns the norm."""
        tensor, value = self.grad_norm() if norm is None else norm
        if self.cfg.grad_clip > 0:  # what clip_grads_with_norm_ does, on each gradient's local part (torch's
            # foreach would refuse a mix of DTensor and plain gradients: tensor parallelism's)
            coef = torch.clamp(self.cfg.grad_clip / (tensor + 1e-6), max=1.0)
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        local.mul_(coef.to(local.device, local.dtype))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return value

    def skip(self) -> None:
        """--on-nonfinite skip: drop the step's gradients without an update; the schedule moves on."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
