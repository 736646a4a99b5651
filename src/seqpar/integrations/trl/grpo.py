"""TRL's ``GRPOTrainer`` and ``RLOOTrainer`` under :func:`seqpar.parallelize_trainer`: generation on
the whole prompt, the training forward (and the reference model's) sharded. RLOO's trainer is GRPO's
loop with another advantage (leave-one-out, its KL in the reward) and a sequence-level loss: the same
mixin serves both.

TRL 1.16 sizes and distributes GRPO by the process count; under seqpar the ``sp`` ranks of a dp group
are one "process" of the script without seqpar, so while a step runs GRPO sees a world of dp ranks::

    generation_batch_size     per_device x dp x steps_per_generation (its config computed it from the world)
    seed                      seed + dp rank (TRL seeds generation per process)
    generation, rewards       the plain model on whole prompts, on every SP rank: the same completions
                              (and the old log-probs, and with peft the reference's: the adapters off)
    reference (beta != 0)     a reference model (TRL loads it from the policy's checkpoint) is
                              parallelized once and run as a ShardedModel: its per-token log-probs
                              equal the unsharded ones; TRL's KL (GRPO: k3 in the loss; RLOO: the
                              log-ratio sum in the reward) and its aggregation run unchanged
    gathers                   rewards, token counts, metrics and logs over the dp ranks only (one copy
                              of each SP group), advantages sliced by the dp rank
    training forward          the model parallelized from compute_loss to the end of the step's backward
                              (activation checkpointing recomputes under it): TRL's loss on the
                              whole-batch log-probs of :class:`~seqpar.integrations.trl.objectives.ShardedModel`
    logged loss               TRL's float32 loss averaged over the SP copies exactly (compat.float64_loss_log)

Anything GRPO does that is not listed here and reads the process count stays TRL's: it is Refused by
option (:func:`check_grpo_options`) where seqpar knows it is not exact.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import nn

from ... import compat
from ...comm import faults
from ...comm.agree import Table, check, share
from ...errors import Refused
from ..hf.parallelize import parallelize, unparallelize
from ..peft import unwrap_peft
from ..state import state_of
from ..trainer.data import sp_groups
from ..trainer.mixin import SeqParTrainerMixin, trl_class, trl_kind
from .objectives import DPGather, ShardedModel, swapped


class DPWorld(DPGather):
    """The accelerator as GRPO must see it under seqpar: dp processes, this rank's dp index, gathers
    over dp (:class:`DPGather`); everything else the accelerator's."""

    def __init__(self, accelerator: Any, state: Any) -> None:
        super().__init__(accelerator, state.mesh, state.dp)
        self.num_processes, self.process_index = state.dp, state.dp_rank

    def gather_object(self, obj: Any) -> list[Any]:
        """accelerate's ``gather_object`` over the dp ranks: the ranks' lists concatenated."""
        if self._group is None:
            return list(obj)
        parts: list[Any] = [None] * self._dp
        dist.all_gather_object(parts, obj, group=self._group)
        return [x for part in parts for x in part]


class SeqParGRPOMixin(SeqParTrainerMixin):
    """Sequence parallelism for TRL's ``GRPOTrainer`` (see the module doc)."""

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: Any):
        """The step's prompt batches; every SP group must hold the same ones (checked on every rank)."""
        with faults.publishing("the Trainer's batches"):
            batches = list(itertools.islice(epoch_iterator, num_batches))  # fewer at the epoch's end
            digest = float(int(hashlib.sha1(repr(batches).encode()).hexdigest()[:12], 16))
            table = share({"count": float(len(batches)), "prompts": digest}, dist.group.WORLD)
            names = {"count": "number of prompt batches in the step", "prompts": "prompts"}
            for ranks in sp_groups(self._seqpar.mesh):
                check(Table([table.rows[r] for r in ranks], [None] * len(ranks)),
                      what=f"GRPO batches of the SP group of ranks {ranks}", same=list(names),
                      describe=names.__getitem__, hint="the ranks of one SP group must read the same prompts")
            return batches, None

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None):
        """GRPO's step (generation, rewards, loss) in a world of dp ranks."""
        world = DPWorld(self.accelerator, self._seqpar)
        try:
            with faults.publishing("the Trainer's training step"), swapped(self, "accelerator", world), \
                    compat.trl_generation_gathers(_trl_module(self), world.gather, world.gather_object), \
                    _sharded_ref(self):
                loss = super(SeqParTrainerMixin, self).training_step(model, inputs, num_items_in_batch)
            return compat.float64_loss_log(self, loss)  # the log averages the SP copies exactly
        finally:  # parallelized by compute_loss, through the backward (activation checkpointing recomputes)
            inner = unwrap_peft(_unwrap_ddp(model))
            if is_parallelized(inner):
                unparallelize(inner)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None):
        """TRL's GRPO loss; the model is parallelized from here to the end of the step's backward
        (generation ran it whole)."""
        state = self._seqpar
        inner = unwrap_peft(_unwrap_ddp(model))
        if not is_parallelized(inner):
            parallelize(inner, state.mesh, strategy=state.strategy)  # undone at the end of training_step
        return super(SeqParTrainerMixin, self).compute_loss(ShardedModel(model, state.mesh, state.layout),
                                                            inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, *args: Any, **kwargs: Any):
        raise Refused(f"seqpar's {trl_kind(type(self))} integration trains; its evaluation is not verified exact: "
                      "evaluate without seqpar (eval_strategy='no' here)")


def _trl_module(trainer: Any) -> str:
    """The module of the trainer's TRL class, whose globals gather / gather_object it calls."""
    klass = trl_class(type(trainer))
    assert klass is not None, type(trainer)
    return klass.__module__


def _sharded_ref(trainer: Any) -> contextlib.AbstractContextManager[None]:
    """For the block, the trainer's reference model (parallelized by :func:`setup_grpo`) is a
    :class:`ShardedModel`: TRL's reference forward in ``_generate_and_score_completions`` runs on this
    rank's shard and hands back the whole batch's per-token log-probs. No reference: nothing."""
    ref = getattr(trainer, "ref_model", None)
    if ref is None:
        return contextlib.nullcontext()
    state = trainer._seqpar
    return swapped(trainer, "ref_model", ShardedModel(ref, state.mesh, state.layout))


def is_parallelized(model: nn.Module) -> bool:
    record = state_of(model)
    return record is not None and record.parallel is not None


def _unwrap_ddp(model: nn.Module) -> nn.Module:
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def setup_grpo(trainer: Any, state: Any) -> None:
    """Refuse what is not exact; size the generation batch and seed generation for dp processes;
    parallelize the reference model (beta != 0 without peft), which only ever runs sharded."""
    from accelerate.utils import set_seed

    check_grpo_options(trainer)
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        parallelize(unwrap_peft(trainer.accelerator.unwrap_model(ref)), state.mesh, strategy=state.strategy)
    args = trainer.args
    args.generation_batch_size = args.per_device_train_batch_size * state.dp * args.steps_per_generation
    if args.generation_batch_size % trainer.num_generations:
        raise ValueError(f"generation_batch_size ({args.generation_batch_size} = per_device_train_batch_size x dp x "
                         f"steps_per_generation) must be divisible by num_generations ({trainer.num_generations})")
    set_seed(args.seed + state.dp_rank)  # TRL's set_seed(seed, device_specific=True) for process dp_rank


def check_grpo_options(trainer: Any) -> None:
    """Refused, by name, for the GRPO / RLOO options seqpar does not run exactly."""
    args = trainer.args
    refused = {
        "use_vllm": bool(getattr(args, "use_vllm", False)),
        "sync_ref_model (the reference mixed into the policy's weights: not verified)":
            bool(getattr(args, "sync_ref_model", False)),
        "use_liger_kernel": bool(getattr(args, "use_liger_kernel", False)),
        "router_aux_loss_coef (a MoE router aux loss)": bool(getattr(trainer, "aux_loss_enabled", False)),
        "eval_strategy": str(getattr(args, "eval_strategy", "no")) not in ("no", "IntervalStrategy.NO"),
        "tools / rollout_func": bool(getattr(trainer, "tools", None)) or getattr(trainer, "rollout_func", None)
        is not None,
    }
    named = [k for k, on in refused.items() if on]
    if named:
        raise Refused(f"seqpar's {trl_kind(type(trainer)) or 'GRPOTrainer'} integration cannot make "
                      f"{', '.join(named)} exact yet: turn "
                      f"{'it' if len(named) == 1 else 'them'} off to train with seqpar")

