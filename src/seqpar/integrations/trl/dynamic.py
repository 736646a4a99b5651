"""TRL's ``DPOTrainer`` and ``RewardTrainer`` under a dynamic SP schedule
(``parallelize_trainer(trainer, mesh, schedule=DynamicSP(...))``): whole pairs per bin, TRL's loss.

Per micro-batch, on every rank (every rank reads every batch, as under :mod:`~seqpar.integrations.trainer.dynamic`)::

    TRL's batch      input_ids [2B, S]: B chosen rows, then their B rejected rows (and DPO's
                     completion_mask, ref_*_logps [B], the reward trainer's margin [B])
    plan             one row per pair: its chosen and rejected real tokens, two documents, so a
                     pair never splits over bins; N = the step's pairs (every micro-batch)
    each of this rank's bins (its pairs b, degree k, this rank's block of k ranks):
        TRL's compute_loss on the bin's pairs [2b, S] through the static mixin's (ShardedModel
        over the block): TRL's mean over the bin's pairs, value x b / N (the bin's share of the
        step's mean over pairs); gradient x W / k as well (ShardedModel already scales it x k:
        each of the k ranks back-propagates its slice, and the world average divides by W)
    after the step's last micro-batch: sync_gradients, the world average

A bin runs as TRL's padded rows (its pairs' rows at the micro-batch's width, sharded over its k
ranks): the plan counts real tokens, so the token budget bounds a bin's real tokens, not its padding.

So each pair weighs 1/N over bins, micro-batches and ranks: the gradient of the step's mean over
pairs, as the script without seqpar takes it (TRL's mean per micro-batch, the Trainer's 1 / grad
accumulation). Exact for a loss that is a mean of per-pair terms; DPO's loss types that couple a
micro-batch's pairs are refused (:data:`BATCH_COUPLED`). TRL's metrics (rewards, log-probs, entropy,
token counts...) are then the mean over this rank's own bins, gathered over no other rank: ranks
run different numbers of bins, so a metric gather would be a collective some ranks never join.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ... import compat
from ...batch.loss import ScaleGrad, sync_gradients
from ...comm import faults
from ...errors import Refused
from ..trainer.dynamic import DynamicTrainerMethods
from ..trainer.mixin import trl_kind
from .objectives import swapped

BATCH_COUPLED = {"aot": "sorts the log-ratios over the micro-batch", "aot_unpaired": "sorts the log-ratios over the "
                 "micro-batch", "sft": "is the token mean of the micro-batch's chosen completions"}
"""DPO loss types (TRL's ``loss_type``, seqpar's ``--dpo-loss``) whose loss couples the pairs of a
micro-batch: a bin holds other pairs than the micro-batch, so they would train to another loss."""


class DynamicPairMethods(DynamicTrainerMethods):
    """The Trainer methods a dynamic SP schedule changes for TRL's DPO and reward trainers (see the
    module doc); the trainer's class becomes ``DynamicPairMethods, its seqpar TRL mixin, its own``."""

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device):
        """The step's micro-batches and N, their pairs (the same on every rank)."""
        with faults.publishing("the Trainer's batches"):
            batches = list(itertools.islice(epoch_iterator, num_batches))  # fewer at the epoch's end
            return batches, float(sum(pairs_in(b) for b in batches)) if batches else None

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None,
                      *args: Any) -> Tensor:
        """This rank's bins of the micro-batch's pairs, TRL's loss on each; the world average
        after the step's last micro-batch."""
        with faults.publishing("the Trainer's training step"):
            model.train()
            inputs = self._prepare_inputs(inputs)  # type: ignore[attr-defined]
            n = float(num_items_in_batch) if num_items_in_batch is not None else float(pairs_in(inputs))
            dyn: Any = self._dynamic
            step = dyn.plan(pair_rows(inputs), num_items=n)
            world, rank = dyn.degrees.world, dist.get_rank(dyn.degrees.all_group)
            no_sync = getattr(model, "no_sync", None)  # DDP: the average is sync_gradients' below
            with no_sync() if callable(no_sync) else contextlib.nullcontext():
                for b in step.schedule.bins_for(rank):
                    # the static mixin's compute_loss over the bin's block: ShardedModel shards over it,
                    # its metric gathers (over the block's dp, 1) stay on this rank
                    with swapped(self, "_seqpar", self._seqpar.over(dyn.degrees.mesh(b.degree))):
                        loss = self.compute_loss(model, pair_batch(inputs, b.rows))  # type: ignore[attr-defined]
                    loss = ScaleGrad.apply(loss * (len(b.rows) / n), world / b.degree)
                    self.accelerator.backward(loss)
                    step.record(loss)
            for k, count in step.schedule.rows_at_degree.items():
                self.rows_at_degree[k] = self.rows_at_degree.get(k, 0) + count
            if self.accelerator.sync_gradients:
                sync_gradients(self.model, self._seqpar.mesh)
            return compat.float64_loss_log(self, step.loss().to(self.args.device).detach())


def pairs_in(batch: Mapping[str, Any]) -> int:
    """The pairs of a TRL preference / reward batch: ``input_ids [2B, S]`` holds B."""
    return int(batch["input_ids"].shape[0]) // 2


def pair_rows(batch: Mapping[str, Any]) -> list[dict[str, Tensor]]:
    """One plan row per pair (on the CPU): its chosen then its rejected real tokens
    (``attention_mask``), positions restarting at the rejected one (two documents). (The planner's
    ``pack_rows`` does the same for seqpar train; this layer may not import the planner.)"""
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    half = pairs_in(batch)
    rows = []
    for i in range(half):
        parts = [ids[j][mask[j].bool()] if mask is not None else ids[j] for j in (i, half + i)]
        rows.append({"input_ids": torch.cat(parts).cpu(),
                     "position_ids": torch.cat([torch.arange(p.numel()) for p in parts])})
    return rows


def pair_batch(batch: Mapping[str, Any], pairs: Sequence[int]) -> dict[str, Any]:
    """TRL's batch of the given pairs only: ``[2B, ...]`` columns keep those pairs' chosen rows then
    their rejected rows, ``[B, ...]`` columns (DPO's ref_*_logps, the reward trainer's margin) those pairs."""
    half = pairs_in(batch)
    index = torch.tensor(list(pairs), dtype=torch.long)
    both = torch.cat([index, index + half])
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if not isinstance(value, Tensor) or value.dim() == 0:
            out[key] = value
        elif value.shape[0] == 2 * half:
            out[key] = value.index_select(0, both.to(value.device))
        elif value.shape[0] == half:
            out[key] = value.index_select(0, index.to(value.device))
        else:
            raise ValueError(f"the batch column {key!r} has {value.shape[0]} rows, neither the {half} pairs nor "
                             f"their {2 * half} rows: a dynamic SP schedule cannot split it by pairs")
    return out


def check_pair_dynamic(trainer: Any) -> None:
    """A TRL objective trainer under ``schedule=``: DPO and reward run, exact; raises ValueError
    seqpar.Refused (a ValueError) naming the option for GRPO, FSDP and DPO's loss types that
    couple a micro-batch's pairs: seqpar cannot make those exact under a dynamic schedule."""
    kind = trl_kind(type(trainer))
    if kind not in ("DPOTrainer", "RewardTrainer"):
        raise Refused(f"a dynamic SP schedule (schedule=) with TRL's {kind} is not supported (its loss runs on "
                         "whole generation groups): leave schedule=None (the static schedule)")
    if getattr(trainer, "is_fsdp_enabled", False):
        raise Refused(f"a dynamic SP schedule with TRL's {kind} runs under DDP only (TRL's fused LM head "
                         "gathers FSDP's sharded head inside each bin): drop fsdp=, or leave schedule=None")
    types = getattr(trainer.args, "loss_type", None) or () if kind == "DPOTrainer" else ()
    coupled = [t for t in types if t in BATCH_COUPLED]
    if coupled:
        raise Refused(f"DPO's loss_type {coupled[0]!r} {BATCH_COUPLED[coupled[0]]}, which a dynamic SP schedule's "
                         f"bins (other pairs than the micro-batch's) would change: leave schedule=None, or use "
                         f"another loss_type (not {', '.join(BATCH_COUPLED)})")
