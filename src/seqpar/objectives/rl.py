"""RL policy losses, the training side (rollouts stay with the generation engine): the clipped
surrogate of GRPO / DAPO / Dr. GRPO / PPO with a KL to a reference, as TRL 1.16's ``GRPOTrainer``
computes it (``loss_type``, ``epsilon``, ``epsilon_high``, ``delta``, ``beta``, ``use_bias_correction_kl``),
per token::

    ratio = exp(logp - old_logp)                  (old_logp: the old policy's; default logp.detach())
    loss_t = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * kl_t
    kl_t = exp(ref - logp) - (ref - logp) - 1     (k3 estimator, with reference log-probs), times ratio
                                                  with use_bias_correction_kl (TRL 1.16's default: the
                                                  unbiased reverse-KL gradient of DeepSeek-V3.2)

``A``: the advantage, one per sequence ``[N]`` (GRPO) or per token ``[B, S]`` (PPO's GAE). The
completion tokens are the labels' non-ignored tokens. Aggregation (``loss_type``):

    "grpo"     sequence-mean-token-mean   mean over sequences of (sum_t loss_t / tokens of the sequence)
    "dr_grpo"  sequence-mean-token-sum    sum over sequences of sum_t loss_t / (sequences * max_completion_length)
    "bnpo"     token-mean                 sum_t loss_t / tokens of this dp rank's batch
    "dapo"     token-mean                 the same, over ``num_units`` = the tokens of the whole step when
                                          given (TRL's num_items_in_batch)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .seam import Needs, Objective, Quantities, Takes, Terms

AGGREGATIONS = {"grpo": "sequence-mean-token-mean", "dr_grpo": "sequence-mean-token-sum", "bnpo": "token-mean",
                "dapo": "token-mean"}


@dataclass
class PolicyGradient(Objective):
    """The clipped policy loss above. Inputs: ``advantages`` (per sequence or per token), optional
    ``old_logps`` and ``ref_logps`` per token ``[B, S]`` aligned with the labels (or ``reference=``).
    PPO's clipped policy loss (TRL ``PPOTrainer``) is ``loss_type="bnpo"`` with per-token advantages."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    max_completion_length: int | None = None
    use_bias_correction_kl: bool = True

    name = "policy_gradient"
    needs = Needs(optional=("advantages", "old_logps"), reference=False)
    takes = Takes(per_token=("logps", "entropy"))
    unit = "token"
    metric_names = ("clip_ratio", "entropy")

    def __post_init__(self) -> None:
        if self.loss_type not in AGGREGATIONS:
            raise ValueError(f"loss_type={self.loss_type!r}: choose from {list(AGGREGATIONS)}")
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ValueError("loss_type='dr_grpo' divides by max_completion_length: set it")
        self.unit = "sequence" if self.loss_type in ("grpo", "dr_grpo") else "token"
        self.needs = Needs(per_row=(), optional=("advantages", "old_logps"), reference=self.beta != 0.0)
        if self.beta != 0.0:  # per instance: the KL term's metric where there is one
            self.metric_names = ("kl", "clip_ratio", "entropy")

    def terms(self, q: Quantities) -> Terms:
        logp = q.token["logps"]  # [B, S_local]
        adv = q.token.get("advantages")
        if adv is None:
            if "advantages" not in q.row:
                raise ValueError("policy_gradient needs advantages (per sequence [N] or per token [B, S])")
            adv = q.row["advantages"].to(logp.dtype)[q.seqs.ids.clamp(min=0)]  # each token its sequence's
        old = q.token.get("old_logps")
        old = logp.detach() if old is None else old.to(logp.dtype)
        coef_1 = torch.exp(logp - old)
        kl = None
        if self.beta != 0.0:
            ref = q.token["ref_logps"].to(logp.dtype)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            if self.use_bias_correction_kl:  # the ratio before delta's clamp, as TRL
                kl = kl * coef_1
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon, 1 + high)
        if self.delta is not None:
            coef_1 = torch.clamp(coef_1, max=self.delta)
        adv = adv.to(logp.dtype)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        metrics: dict[str, Tensor] = {}
        if kl is not None:
            per_token = per_token + self.beta * kl
            metrics["kl"] = q.sums(kl.detach()).sum() / q.counts.sum().clamp(min=1.0)
        seq_sums = q.sums(per_token)  # [N]
        n_tok = q.counts.sum()
        if self.loss_type == "grpo":
            total, count = (seq_sums / q.counts.clamp(min=1.0)).sum(), q.seqs.count
        elif self.loss_type == "dr_grpo":
            total, count = seq_sums.sum() / self.max_completion_length, q.seqs.count
        else:
            total, count = seq_sums.sum(), float(n_tok)
        ent = q.sums(q.token["entropy"].detach()).sum() / n_tok.clamp(min=1.0)
        clipped = ((coef_1 < 1 - self.epsilon) & (adv < 0)) | ((coef_1 > 1 + high) & (adv > 0))
        metrics["clip_ratio"] = q.sums(clipped.to(logp.dtype)).sum() / n_tok.clamp(min=1.0)
        metrics["entropy"] = ent
        return Terms(total, count, metrics)
