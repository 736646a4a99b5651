"""The mixins :func:`seqpar.parallelize_trainer` puts over TRL's ``DPOTrainer`` and ``RewardTrainer``
(how they are exact: :mod:`seqpar.integrations.trl.objectives`), and the TRL options they refuse;
``KTOTrainer``'s lives in :mod:`seqpar.integrations.trl.kto`, ``GRPOTrainer`` / ``RLOOTrainer``'s in
:mod:`seqpar.integrations.trl.grpo`; which class gets which: :mod:`seqpar.integrations.trl.registry`.

Each mixin overrides ``compute_loss`` only to hand TRL's own ``compute_loss`` a
:class:`~seqpar.integrations.trl.objectives.ShardedModel` in place of the model (and of DPO's
reference model): TRL's loss, its loss types and its metrics run unchanged on whole-batch tensors.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from ... import compat
from ...errors import Refused
from ..hf.parallelize import parallelize
from ..peft import is_peft_model, unwrap_peft
from ..trainer.mixin import SeqParTrainerMixin, trl_kind
from .objectives import DPGather, ShardedModel, swapped

DPO_BATCH_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")
REWARD_BATCH_KEYS = ("margin",)


class SeqParTRLMixin(SeqParTrainerMixin):
    """What the TRL objective trainers' mixins share: the logged loss, averaged over the SP copies exactly."""

    def training_step(self, *args: Any, **kwargs: Any):
        """The Trainer's step; its logged loss averaged over the SP copies exactly
        (:func:`seqpar.compat.float64_loss_log`)."""
        return compat.float64_loss_log(self, super().training_step(*args, **kwargs))


class SeqParDPOMixin(SeqParTRLMixin):
    """Sequence parallelism for TRL's ``DPOTrainer``: its loss types, its reference (a model, or
    ``precompute_ref_log_probs``), its metrics."""

    seqpar_batch_keys = DPO_BATCH_KEYS

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None):
        """TRL's DPO loss, the policy and the reference run on this rank's shard."""
        state = self._seqpar
        ref = self.ref_model
        swap = (swapped(self, "ref_model", ShardedModel(ref, state.mesh, state.layout)) if ref is not None
                else contextlib.nullcontext())
        with swap, dp_metrics(self):
            return super(SeqParTrainerMixin, self).compute_loss(ShardedModel(model, state.mesh, state.layout),
                                                                inputs, return_outputs, num_items_in_batch)

    def compute_ref_log_probs(self, model: nn.Module, inputs: dict[str, Any]):
        """TRL's precomputed reference log-probs (an eval dataset given to ``evaluate`` later), sharded."""
        state = self._seqpar
        return super(SeqParTrainerMixin, self).compute_ref_log_probs(ShardedModel(model, state.mesh, state.layout),
                                                                     inputs)

    def prediction_step(self, *args: Any, **kwargs: Any):
        """TRL's (its loss through :meth:`compute_loss`)."""
        return super(SeqParTrainerMixin, self).prediction_step(*args, **refuse_eval_over_dp(self, kwargs))


class SeqParRewardMixin(SeqParTRLMixin):
    """Sequence parallelism for TRL's ``RewardTrainer``: Bradley-Terry on chosen / rejected rows,
    with its ``margin`` column and ``center_rewards_coefficient``, and its metrics."""

    seqpar_batch_keys = REWARD_BATCH_KEYS

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None):
        """TRL's reward loss, the scores read at each row's last token wherever it lives."""
        state = self._seqpar
        sharded = ShardedModel(model, state.mesh, state.layout, unread=REWARD_BATCH_KEYS)
        with dp_metrics(self):
            return super(SeqParTrainerMixin, self).compute_loss(sharded, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, *args: Any, **kwargs: Any):
        """The Trainer's (its loss through :meth:`compute_loss`)."""
        return super(SeqParTrainerMixin, self).prediction_step(*args, **refuse_eval_over_dp(self, kwargs))


def refuse_eval_over_dp(trainer: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Refused at dp > 1: under seqpar every rank evaluates every batch, while TRL's eval metrics
    gather one share per process (not verified exact); ``kwargs`` back otherwise."""
    if trainer._seqpar.dp > 1:
        raise Refused(f"seqpar's {trl_kind(type(trainer))} integration evaluates with dp=1 only (dp="
                      f"{trainer._seqpar.dp} here): evaluate on sp ranks only, or without seqpar")
    return kwargs


def dp_metrics(trainer: Any) -> contextlib.AbstractContextManager[None]:
    """The trainer's metric gathers over the dp ranks only, for the block (:class:`DPGather`)."""
    state = trainer._seqpar
    return swapped(trainer, "accelerator", DPGather(trainer.accelerator, state.mesh, state.dp))



def setup_trl(trainer: Any, state: Any) -> None:
    """Refuse what seqpar cannot make exact; parallelize the model and DPO's reference model."""
    check_trl_options(trainer)
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        parallelize(unwrap_peft(trainer.accelerator.unwrap_model(ref)), state.mesh, strategy=state.strategy)
    parallelize(unwrap_peft(trainer.model), state.mesh, strategy=state.strategy)


def check_trl_options(trainer: Any) -> None:
    """Refused, by name, for the TRL options whose result seqpar cannot make exact."""
    args = trainer.args
    kind = trl_kind(type(trainer))
    refused = {
        "use_liger_kernel": bool(getattr(args, "use_liger_kernel", False)),
        "router_aux_loss_coef (a MoE router aux loss)": bool(getattr(trainer, "aux_loss_enabled", False)),
        "compute_loss_func": getattr(trainer, "compute_loss_func", None) is not None,
    }
    if kind == "KTOTrainer":
        refused["evaluation (eval_strategy: not verified exact)"] = (
            str(getattr(args, "eval_strategy", "no")) not in ("no", "IntervalStrategy.NO"))
    if kind in ("DPOTrainer", "KTOTrainer"):  # TRL calls the whole model with its adapters off inside its loss
        refused["a peft model without ref_model (the reference is the model with its adapters off)"] = (
            trainer.ref_model is None and not trainer.precompute_ref_logps and is_peft_model(trainer.model))
    named = [k for k, on in refused.items() if on]
    if named:
        raise Refused(f"seqpar's {kind} integration cannot make {', '.join(named)} exact: turn "
                      f"{'it' if len(named) == 1 else 'them'} off to train with seqpar")
