"""Reward and value models: the score head of an ``AutoModelForSequenceClassification`` at each
sequence's last real token (which lives on one SP rank: the others contribute 0 to its sum), and the
same head on every token as a value head.

    BradleyTerry             chosen / rejected scores, TRL 1.16 ``RewardTrainer``'s loss (``margin``,
                             ``center_rewards_coefficient``)
    SequenceClassification   one label per sequence: cross entropy (classes) or MSE (one output,
                             regression), as transformers' ``ForSequenceClassification`` loss
    ValueLoss                a value per token against per-token ``returns``, clipped around
                             ``old_values`` as TRL's ``PPOTrainer`` (``0.5 * token-mean of max(...)``)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .seam import Needs, Objective, Quantities, Takes, Terms


@dataclass
class BradleyTerry(Objective):
    """``-logsigmoid(r_chosen - r_rejected - margin)``, plus ``center_rewards_coefficient * (r_c + r_r)^2``
    when set; the mean over pairs. ``margin``: optional input, one per pair."""

    center_rewards_coefficient: float | None = None
    pairing: str = "halves"

    name = "bradley_terry"
    needs = Needs(rows="pairs", per_pair=("margin",))
    takes = Takes(per_row=("score",))
    unit = "pair"
    metric_names = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")

    def terms(self, q: Quantities) -> Terms:
        score = q.row["score"]
        if score.shape[-1] != 1:
            raise ValueError(f"a reward model has one output (num_labels=1), this one has {score.shape[-1]}")
        c, r = self.pairs(score[:, 0])
        diff = c - r
        if "margin" in q.row:
            diff = diff - q.row["margin"].to(diff.dtype)
        losses = -F.logsigmoid(diff)
        if self.center_rewards_coefficient is not None:
            losses = losses + self.center_rewards_coefficient * (c + r) ** 2
        return Terms(losses.sum(), c.shape[0], {"accuracy": (c > r).to(c.dtype).mean(), "margin": (c - r).mean(),
                                                 "rewards/chosen": c.mean(), "rewards/rejected": r.mean()})


@dataclass
class SequenceClassification(Objective):
    """One ``labels`` value per sequence (input): class ids with ``problem_type="single_label_classification"``
    (cross entropy), targets with ``"regression"`` (mean squared error; one output), the mean over
    sequences. Default: regression for one output, classes otherwise (transformers' rule for int labels)."""

    problem_type: str | None = None

    name = "sequence_classification"
    needs = Needs(per_row=("labels",))
    takes = Takes(per_row=("score",))
    unit = "sequence"

    def terms(self, q: Quantities) -> Terms:
        score, labels = q.row["score"], q.row["labels"]  # [N, K], [N] or [N, K]
        kind = self.problem_type or ("regression" if score.shape[-1] == 1 else "single_label_classification")
        if kind == "regression":
            target = labels.to(score.dtype).reshape(score.shape)
            losses = ((score - target) ** 2).sum(-1) / score.shape[-1]
        elif kind == "single_label_classification":
            losses = F.cross_entropy(score.to(torch.promote_types(score.dtype, torch.float32)), labels.long(),
                                     reduction="none")
        else:
            raise ValueError(f"problem_type={kind!r}: choose 'regression' or 'single_label_classification'")
        return Terms(losses.sum(), score.shape[0], {})


@dataclass
class ValueLoss(Objective):
    """``0.5 * token-mean of max((v - R)^2, (clip(v, old - c, old + c) - R)^2)`` over the completion
    tokens. Inputs per token ``[B, S]`` aligned with the labels: ``returns`` and, with ``clip``,
    ``old_values``. The value of position i is read at the position that predicts token i (as
    TRL's ``values[:, context_length - 1 : -1]``), so both inputs shift with the labels."""

    clip: float | None = None

    name = "value"
    needs = Needs(per_token=("returns",), optional=("old_values",))
    takes = Takes(per_token=("values",))
    unit = "token"

    def terms(self, q: Quantities) -> Terms:
        v = q.token["values"]
        ret = q.token["returns"].to(v.dtype)
        err = (v - ret) ** 2
        if self.clip is not None:
            if "old_values" not in q.token:
                raise ValueError("ValueLoss(clip=...) clips around old_values: pass them per token [B, S]")
            old = q.token["old_values"].to(v.dtype)
            err = torch.max(err, (torch.clamp(v, old - self.clip, old + self.clip) - ret) ** 2)
        n = q.counts.sum()
        return Terms(0.5 * q.sums(err).sum(), float(n), {})
