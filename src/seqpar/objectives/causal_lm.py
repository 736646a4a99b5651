"""The causal-LM token mean (SFT and pre-training) as one objective among the others.

``CausalLM()(model, local, mesh).loss`` equals ``model(**local).loss`` of a parallelized model: the
(weighted) cross entropy of every target over N, N being shard_batch's denominator -- this dp rank's
target count, or the ``num_items_in_batch`` it was given (then global: the gradient is scaled for the
dp average). It runs the head in vocabulary tiles whether or not :func:`seqpar.reduce_memory` is on.
``model(**local).loss`` (the model's own ``loss_function``, :mod:`seqpar.batch.loss`) stays the path of
``seqpar train`` and the Trainer integration; this is the seam's adapter for the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from .seam import Needs, Objective, Quantities, Takes, Terms


@dataclass
class CausalLM(Objective):
    """The causal-LM loss: ``sum of w_i * CE_i / N`` over the targets (see the module doc)."""

    name = "causal_lm"
    needs = Needs()
    takes = Takes(per_token=("logps",))
    unit = "token"

    def terms(self, q: Quantities) -> Terms:
        nll = -q.token["logps"]
        if q.batch.loss_weights is not None:
            nll = nll * q.batch.loss_weights.to(nll)
        total = q.sums(nll).sum()
        return Terms(total, q.batch.denominator, {}, global_count=q.batch.num_items_in_batch is not None)
