"""The causal-LM token mean (SFT and pre-training) as one objective among the others.

``CausalLM()(model, local, mesh).loss`` equals ``model(**local).loss`` of a parallelized model: the
(weighted) cross entropy of every target over N, N being shard_batch's denominator -- this dp rank's
target count, or the ``num_items_in_batch`` it was given, or ``num_units`` (then global: the gradient
is scaled for the dp average). It runs the head in vocabulary tiles whether or not
:func:`seqpar.reduce_memory` is on. ``seqpar train --objective sft`` takes its loss from here, in
training and (``accuracy=True``: the greedy accuracy over the targets as a metric) in evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

from .seam import Needs, Objective, Quantities, Takes, Terms


@dataclass
class CausalLM(Objective):
    """The causal-LM loss: ``sum of w_i * CE_i / N`` over the targets (see the module doc).
    ``accuracy``: also the metric ``"accuracy"``, the share of targets that are the argmax of the
    logits (an evaluation's: one more pass of the head, no gradient)."""

    accuracy: bool = False

    name = "causal_lm"
    needs = Needs()
    takes = Takes(per_token=("logps",))
    unit = "token"

    def __post_init__(self) -> None:
        if self.accuracy:  # per instance: training runs without the extra pass
            self.takes = Takes(per_token=("logps", "correct"))
            self.metric_names = ("accuracy",)

    def terms(self, q: Quantities) -> Terms:
        nll = -q.token["logps"]
        if q.batch.loss_weights is not None:
            nll = nll * q.batch.loss_weights.to(nll)
        total = q.sums(nll).sum()
        metrics = {}
        if self.accuracy:
            hits = q.sums(q.token["correct"].to(nll.dtype)).sum()
            metrics["accuracy"] = hits / max(float(q.counts.sum()), 1.0)
        return Terms(total, q.batch.denominator, metrics, global_count=q.batch.num_items_in_batch is not None)
