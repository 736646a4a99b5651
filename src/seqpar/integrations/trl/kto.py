"""TRL's ``KTOTrainer`` under :func:`seqpar.parallelize_trainer`: unpaired completions, each desirable
or not (its ``label``), against a reference, with TRL's own loss (how it is exact:
:mod:`seqpar.integrations.trl.objectives`)::

    TRL compute_loss                   (KTO's batch: B completions, B mismatched KL completions)
      model(input_ids [B, S], ...)       -> ShardedModel: log-probs, entropy, mean logits [B, S-1]
      KL completions (no grad)           -> ShardedModel, the policy's and the reference's
      ref_model(...)                     -> ShardedModel over the parallelized reference
      kl = gather_for_metrics(mean).mean().clamp(min=0)   over the dp ranks only (DPGather): the same
                                         processes' estimates the script without seqpar averages
      loss, metrics                      TRL's, on tensors equal to the unsharded run's

KTO's KL estimate couples a micro-batch's completions (and the dp ranks'), which is why a dynamic SP
schedule (bins of other rows) is refused. A peft model without ``ref_model`` is refused (TRL runs the
whole model with its adapters off inside its loss), and so is evaluation (not verified); precomputed
reference log-probs (``precompute_ref_log_probs``) are TRL's, computed before seqpar is applied.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...errors import Refused
from ..trainer.mixin import SeqParTrainerMixin
from .mixins import SeqParTRLMixin, dp_metrics
from .objectives import ShardedModel, swapped

KTO_BATCH_KEYS = ("completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask", "label",
                  "ref_logps", "ref_KL_logps")
"""The columns of TRL's KTO collator besides the model's (compared across an SP group, not sharded)."""


class SeqParKTOMixin(SeqParTRLMixin):
    """Sequence parallelism for TRL's ``KTOTrainer`` (see the module doc): its loss types ("kto",
    "apo_zero_unpaired"), the KL estimate, the desirable / undesirable weights, its reference (a model
    or ``precompute_ref_log_probs``) and its metrics."""

    seqpar_batch_keys = KTO_BATCH_KEYS

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None):
        """TRL's KTO loss, the policy and the reference run on this rank's shard."""
        state = self._seqpar
        ref = self.ref_model
        with swapped(self, "ref_model", ShardedModel(ref, state.mesh, state.layout) if ref is not None else None), \
                dp_metrics(self):
            return super(SeqParTrainerMixin, self).compute_loss(ShardedModel(model, state.mesh, state.layout),
                                                                inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, *args: Any, **kwargs: Any):
        raise Refused("seqpar's KTOTrainer integration trains; its evaluation is not verified exact: evaluate "
                      "without seqpar (eval_strategy='no' here)")
