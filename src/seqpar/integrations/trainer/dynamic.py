"""A dynamic SP schedule inside ``transformers.Trainer`` (and subclasses)::

    dyn = seqpar.planner.bins.DynamicSP(mesh, token_budget=1024, cost=cost)   # tokens per rank per bin
    seqpar.parallelize_trainer(trainer, mesh, schedule=dyn)

Each micro-batch's rows are binned and each bin runs at the SP degree its longest row needs, on
sub-groups of the ``dp x sp`` ranks (:class:`~seqpar.planner.bins.DynamicSP`; a cost model:
:func:`seqpar.planner.model_cost.model_cost`); the step stays the unsharded model's step::

    data        every rank reads the same batches (the train loader is not split): a step's rows are
                its micro-batches' rows (per_device_train_batch_size x gradient_accumulation_steps),
                binned over all ranks -- what the run without seqpar reads on one process
    per step    get_batch_samples: the micro-batches and N = their targets (every rank holds every
                row: no collective)
    per micro   training_step: schedule.plan(rows, num_items=N) -- ranks that disagree raise the same
                ValueError before any other collective -- then this rank's bins, forward and backward
                under DDP's no_sync; after the step's last micro-batch seqpar.sync_gradients: the world
                average, the unsharded model's gradient of the step's token mean. Returns the
                micro-batch's share of that mean (the same on every rank, as the Trainer logs it)
    eval        as the static schedule (whole batches over the job's SP group)

    FSDP2       accelerate's FSDP2 (``fsdp_config={"version": 2}``): the bins run through
                ``StepBins.fsdp`` (gradient sync held back until this rank's last bin, then one flush
                pass every rank runs, so every rank runs the same FSDP collectives), with the
                parameters kept gathered from forward to backward (``set_reshard_after_forward(False)``
                for the step, the plugin's setting restored after); FSDP2's reduce-scatter is the
                world average, so no sync_gradients

accelerate's FSDP1 and DeepSpeed are refused: their collectives run inside each backward, which
ranks running different bins cannot match. TRL's DPO and reward trainers: whole pairs per bin,
:mod:`~seqpar.integrations.trl.dynamic`.
This module imports nothing of :mod:`~seqpar.integrations.trainer.mixin`: ``parallelize_trainer`` puts
:class:`DynamicTrainerMethods` before ``SeqParTrainerMixin`` in the trainer's class.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...batch.loss import sync_gradients
from ...comm import faults
from .data import model_batch, split_loader


class StepSchedule(Protocol):
    """What the Trainer needs of a dynamic schedule (:class:`seqpar.planner.bins.DynamicSP`)."""

    layout: str

    def targets(self, rows: Sequence[Mapping[str, Any]]) -> float: ...

    def plan(self, rows: Sequence[Mapping[str, Any]], *, num_items: float | None = None) -> Any: ...


class DynamicTrainerMethods:
    """The Trainer methods a dynamic SP schedule changes (see the module doc); the trainer's class
    becomes ``DynamicTrainerMethods, SeqParTrainerMixin, its own`` (``parallelize_trainer``)."""

    _dynamic: StepSchedule
    _seqpar: Any  # the mesh's state, set by parallelize_trainer
    accelerator: Any
    args: Any
    model: nn.Module
    rows_at_degree: dict[int, int]  # rows trained at each SP degree, the run so far

    def get_train_dataloader(self):
        """The Trainer's train loader, unsplit (the split over dp undone): every rank reads every row."""
        return split_loader(super().get_train_dataloader(), 1, 0)  # type: ignore[misc]

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device):
        """The step's micro-batches and N, their targets (the same on every rank)."""
        with faults.publishing("the Trainer's batches"):
            batches = list(itertools.islice(epoch_iterator, num_batches))  # fewer at the epoch's end
            if batches and "labels" not in batches[0]:
                raise ValueError("the batch has no labels: seqpar's Trainer integration trains a causal LM on labels")
            return batches, sum(self._dynamic.targets(batch_rows(b)) for b in batches) if batches else None

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None,
                      *args: Any) -> Tensor:
        """This rank's bins of the micro-batch; the world average after the step's last one."""
        with faults.publishing("the Trainer's training step"):
            model.train()
            n = None if num_items_in_batch is None else float(num_items_in_batch)
            step = self._dynamic.plan(batch_rows(inputs), num_items=n)
            fsdp = getattr(self, "is_fsdp_enabled", False)  # FSDP2 (check_dynamic refused FSDP1)
            plugin = self.accelerator.state.fsdp_plugin if fsdp else None
            with fsdp2_bins(step, model, plugin) if fsdp else plain_bins(step, model) as bins:
                for local in bins:
                    loss = model(**local).loss
                    self.accelerator.backward(loss)
                    step.record(loss)
            for k, count in step.schedule.rows_at_degree.items():
                self.rows_at_degree[k] = self.rows_at_degree.get(k, 0) + count
            if self.accelerator.sync_gradients and not fsdp:  # FSDP2's reduce-scatter already averaged
                sync_gradients(self.model, self._seqpar.mesh)
            return step.loss().to(self.args.device).detach()


@contextlib.contextmanager
def plain_bins(step: Any, model: nn.Module) -> Iterator[Iterable[dict[str, Any]]]:
    """This rank's bins of ``step``; under DDP with its sync off (the average is sync_gradients')."""
    no_sync = getattr(model, "no_sync", None)
    with no_sync() if callable(no_sync) else contextlib.nullcontext():
        yield step


@contextlib.contextmanager
def fsdp2_bins(step: Any, model: Any, plugin: Any) -> Iterator[Iterable[dict[str, Any]]]:
    """This rank's bins of ``step`` for accelerate's FSDP2 root ``model``: ``step.fsdp(model)``, with
    the parameters kept gathered from forward to backward meanwhile (a bin's backward must all-gather
    nothing: ranks with fewer bins would never join), then ``plugin.reshard_after_forward`` back (the
    root's own False, FSDP2's default for the root)."""
    if not callable(getattr(model, "set_reshard_after_forward", None)):
        raise ValueError(f"accelerate's FSDP is on but the Trainer's model is a {type(model).__name__}, not an "
                         "FSDP2 module (fully_shard): a dynamic SP schedule needs FSDP2 (fsdp_config "
                         "version 2) and no torch_compile")
    model.set_reshard_after_forward(False)
    try:
        yield step.fsdp(model)
    finally:
        model.set_reshard_after_forward(bool(getattr(plugin, "reshard_after_forward", True)))
        model.set_reshard_after_forward(False, recurse=False)


def batch_rows(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A collated ``[B, S]`` batch as ``B`` rows (on the CPU; padding stays, marked by
    ``attention_mask``: a bin packs real tokens only)."""
    batch = {k: v for k, v in model_batch(batch).items() if v is not None}
    return [{k: v[i].cpu() for k, v in batch.items()} for i in range(batch["input_ids"].shape[0])]


def check_dynamic(trainer: Any, mesh: DeviceMesh | None, schedule: StepSchedule, *, sp: int | None,
                  layout: str) -> str:
    """``parallelize_trainer(trainer, mesh, schedule=...)``'s own checks; returns the layout (the
    schedule's). Raises ValueError without the mesh the schedule was built over, for a ``layout``
    other than the schedule's, and for accelerate's FSDP1 or DeepSpeed (naming the option)."""
    if mesh is None or sp is not None:
        raise ValueError("parallelize_trainer(trainer, mesh, schedule=...) takes the mesh the schedule was built "
                         "over (DynamicSP(mesh, ...)), not sp=")
    if layout not in ("contiguous", schedule.layout):
        raise ValueError(f"layout={layout!r} differs from the schedule's {schedule.layout!r}: give "
                         f"DynamicSP(..., layout={layout!r}) instead")
    why = ("a dynamic SP schedule runs a different number of bins on each rank, which {} collectives inside "
           "each backward cannot follow: {}, or parallelize_trainer without schedule=")
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError(why.format("DeepSpeed's (TrainingArguments.deepspeed)",
                                    "drop deepspeed= and use FSDP2 (fsdp_config={'version': 2}) or plain DDP"))
    if getattr(trainer, "is_fsdp_enabled", False):
        version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version != 2:
            raise ValueError(why.format(f"FSDP{version}'s (fsdp_config version={version})",
                                        "use FSDP2 (fsdp_config={'version': 2}, run exact) or plain DDP"))
    return schedule.layout
