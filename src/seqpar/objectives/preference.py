"""Preference optimisation: DPO and its loss variants, reference-free pair losses (SimPO, ORPO) and
KTO (unpaired). The formulas are TRL 1.16's (``DPOTrainer``, ``CPOTrainer``'s ``simpo``,
``ORPOTrainer``, ``KTOTrainer``); the log-probability of a completion is the sum of its tokens'
(the labels' non-ignored tokens), over the whole sequence wherever its tokens live.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .seam import Needs, Objective, Quantities, Takes, Terms

DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")


def _dpo_term(kind: str, beta: float, ls: float, tau: float, c: Tensor, r: Tensor, c_ref: Tensor, r_ref: Tensor,
              n_c: Tensor, n_r: Tensor, c_tok: Tensor) -> Tensor:
    """One DPO loss type per pair ``[pairs]`` (TRL 1.16 ``DPOTrainer._compute_loss``, reverse KL).
    ``c, r``: chosen / rejected log-prob sums; ``n_*``: their token counts; ``c_tok``: the chosen
    tokens' summed log-probs and count, for "sft"."""
    cl, rl = c - c_ref, r - r_ref  # log ratios
    delta = cl - rl
    if kind == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if kind == "hinge":
        return torch.relu(1 - beta * delta)
    if kind == "ipo":
        return (cl / n_c.clamp(min=1.0) - rl / n_r.clamp(min=1.0) - 1 / (2 * beta)) ** 2
    if kind == "exo_pair":
        eps = torch.tensor(ls, dtype=delta.dtype, device=delta.device)
        return (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-eps))
                + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(eps)))
    if kind == "nca_pair":
        return -F.logsigmoid(beta * cl) - 0.5 * F.logsigmoid(-beta * cl) - 0.5 * F.logsigmoid(-beta * rl)
    if kind == "robust":
        return (-(1 - ls) * F.logsigmoid(beta * delta) + ls * F.logsigmoid(-beta * delta)) / (1 - 2 * ls)
    if kind == "bco_pair":
        return -F.logsigmoid(beta * cl) - F.logsigmoid(-beta * rl)
    if kind == "sppo_hard":
        return (cl - 0.5 / beta) ** 2 + (rl + 0.5 / beta) ** 2
    if kind in ("aot", "aot_unpaired"):
        a, b = ((c - r, c_ref - r_ref) if kind == "aot" else (cl, rl))
        d = torch.sort(a, dim=0)[0] - torch.sort(b, dim=0)[0]
        return -F.logsigmoid(beta * d) * (1 - ls) - F.logsigmoid(-beta * d) * ls
    if kind == "apo_zero":
        return 1 - torch.sigmoid(beta * cl) + torch.sigmoid(beta * rl)
    if kind == "apo_down":
        return torch.sigmoid(beta * cl) + 1 - torch.sigmoid(beta * delta)
    if kind == "discopop":
        z = beta * delta
        mix = torch.sigmoid(z / tau)
        return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
    if kind == "sft":  # the chosen tokens' mean NLL, the same for every pair
        return (-c_tok[0] / c_tok[1].clamp(min=1.0)).expand(c.shape[0])
    if kind == "sigmoid_norm":
        return -F.logsigmoid(beta * (cl / n_c.clamp(min=1.0) - rl / n_r.clamp(min=1.0)))
    raise AssertionError(kind)


@dataclass
class DPO(Objective):
    """Direct Preference Optimisation (TRL 1.16 ``DPOConfig``: ``beta``, ``loss_type`` (one name or a
    list, weighted by ``loss_weights``), ``label_smoothing``, ``discopop_tau``). Rows: pairs of
    sequences, chosen then rejected (``pairing``). Needs reference log-probs. Loss: the mean over pairs."""

    beta: float = 0.1
    loss_type: str | Sequence[str] = "sigmoid"
    loss_weights: Sequence[float] | None = None
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    pairing: str = "halves"

    name = "dpo"
    needs = Needs(rows="pairs", reference=True)
    takes = Takes(per_token=("logps",))
    unit = "pair"
    metric_names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                    "logps/rejected")

    def __post_init__(self) -> None:
        self.types = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        unknown = [t for t in self.types if t not in DPO_LOSSES]
        if unknown or not self.types:
            raise ValueError(f"DPO loss_type {unknown or self.types}: choose from {list(DPO_LOSSES)}")
        self.weights = [1.0] * len(self.types) if self.loss_weights is None else list(self.loss_weights)
        if len(self.weights) != len(self.types):
            raise ValueError(f"loss_weights has {len(self.weights)} entries for {len(self.types)} loss types")
        if "robust" in self.types and not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={self.label_smoothing}: the robust loss needs it in [0, 0.5)")
        if "exo_pair" in self.types and self.label_smoothing == 0.0:
            raise ValueError("the exo_pair loss needs label_smoothing > 0 (1e-3 in the EXO paper)")

    def terms(self, q: Quantities) -> Terms:
        logps = q.sums(q.token["logps"])  # [N]
        c, r = self.pairs(logps)
        c_ref, r_ref = self.pairs(q.row["ref_logps"].to(logps.dtype))
        n_c, n_r = self.pairs(q.counts)
        c_tok = torch.stack([c.sum(), n_c.sum()])
        total = logps.new_zeros(())
        for kind, w in zip(self.types, self.weights, strict=True):
            term = _dpo_term(kind, self.beta, self.label_smoothing, self.discopop_tau, c, r, c_ref, r_ref, n_c, n_r,
                             c_tok)
            total = total + w * term.sum()
        chosen, rejected = self.beta * (c - c_ref), self.beta * (r - r_ref)
        metrics = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
                   "rewards/margins": (chosen - rejected).mean(),
                   "rewards/accuracies": (chosen > rejected).to(logps.dtype).mean(),
                   "logps/chosen": c.mean(), "logps/rejected": r.mean()}
        return Terms(total, c.shape[0], metrics)


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable (TRL's ORPO helper)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class ReferenceFreePairs(Objective):
    """What SimPO and ORPO share: pairs of sequences, each completion's token log-probs, no reference,
    a loss over pairs."""

    needs = Needs(rows="pairs")
    takes = Takes(per_token=("logps",))
    unit = "pair"

    def mean_logps(self, q: Quantities) -> tuple[Tensor, Tensor]:
        """``(chosen, rejected)`` mean token log-probs of each pair's completions ``[pairs]``."""
        return self.pairs(q.sums(q.token["logps"]) / q.counts.clamp(min=1.0))


@dataclass
class SimPO(ReferenceFreePairs):
    """SimPO (TRL 1.16 ``CPOTrainer``, ``loss_type="simpo"``, ``cpo_alpha=0``): reference-free, on the
    *mean* token log-prob of each completion, ``-logsigmoid(beta * (mean_c - mean_r - gamma / beta))``
    (with ``label_smoothing`` as CPO's). Loss: the mean over pairs."""

    beta: float = 2.0
    gamma: float = 0.5
    label_smoothing: float = 0.0
    pairing: str = "halves"

    name = "simpo"
    metric_names = ("logps/chosen", "logps/rejected", "rewards/accuracies")

    def terms(self, q: Quantities) -> Terms:
        c, r = self.mean_logps(q)
        z = self.beta * (c - r - self.gamma / self.beta)
        losses = -F.logsigmoid(z) * (1 - self.label_smoothing) - F.logsigmoid(-z) * self.label_smoothing
        return Terms(losses.sum(), c.shape[0], {"logps/chosen": c.mean(), "logps/rejected": r.mean(),
                                                 "rewards/accuracies": (c > r).to(c.dtype).mean()})


@dataclass
class ORPO(ReferenceFreePairs):
    """ORPO (TRL 1.16 ``ORPOTrainer``): the chosen completions' token-mean NLL minus ``beta`` times the
    mean log-sigmoid of the log odds ratio of the mean token log-probs. Reference-free. Loss: per pair
    ``nll - beta * logsigmoid(log_odds)``, the NLL a batch-level token mean (as ORPO's)."""

    beta: float = 0.1
    pairing: str = "halves"

    name = "orpo"
    # nll_loss is the batch's token mean, not a pair mean: weighed by pairs, it is exact for equal batches
    metric_names = ("nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/accuracies")

    def terms(self, q: Quantities) -> Terms:
        c_sum, _ = self.pairs(q.sums(q.token["logps"]))
        n_c, _ = self.pairs(q.counts)
        c, r = self.mean_logps(q)
        nll = -c_sum.sum() / n_c.sum().clamp(min=1.0)
        log_odds = (c - r) - (_log1mexp(c) - _log1mexp(r))
        ratio = F.logsigmoid(log_odds)
        total = c.shape[0] * nll - self.beta * ratio.sum()
        return Terms(total, c.shape[0], {"nll_loss": nll, "log_odds_ratio": ratio.mean(),
                                          "log_odds_chosen": log_odds.mean(),
                                          "rewards/accuracies": (c > r).to(c.dtype).mean()})


@dataclass
class KTO(Objective):
    """KTO (TRL 1.16 ``KTOTrainer``): unpaired sequences, each ``desirable`` (bool per sequence) or not,
    with reference log-probs. ``kl`` input: the batch's KL estimate as KTO computes it from mismatched
    completions (detached; clamped at 0); default 0. ``loss_type``: "kto" or "apo_zero_unpaired".
    Loss: the mean over sequences of the weighted losses."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"

    name = "kto"
    needs = Needs(per_row=("desirable",), optional=("kl",), reference=True)
    takes = Takes(per_token=("logps",))
    unit = "sequence"

    def __post_init__(self) -> None:
        if self.loss_type not in ("kto", "apo_zero_unpaired"):
            raise ValueError(f"KTO loss_type={self.loss_type!r}: choose 'kto' or 'apo_zero_unpaired'")

    def terms(self, q: Quantities) -> Terms:
        logps = q.sums(q.token["logps"])
        ratio = logps - q.row["ref_logps"].to(logps.dtype)
        good = q.row["desirable"].to(torch.bool)
        kl = q.row.get("kl")
        kl = logps.new_zeros(()) if kl is None or self.loss_type != "kto" else kl.to(logps).reshape(()).clamp(min=0)
        if self.loss_type == "kto":
            up, down = 1 - torch.sigmoid(self.beta * (ratio - kl)), 1 - torch.sigmoid(self.beta * (kl - ratio))
        else:
            up, down = 1 - torch.sigmoid(self.beta * ratio), torch.sigmoid(self.beta * ratio)
        losses = torch.where(good, self.desirable_weight * up, self.undesirable_weight * down)
        rewards = self.beta * ratio
        return Terms(losses.sum(), good.numel(), {"rewards/desirable": rewards[good].sum() / max(int(good.sum()), 1),
                                                   "rewards/undesirable": rewards[~good].sum()
                                                   / max(int((~good).sum()), 1)})


@dataclass
class KTOKL(Objective):
    """KTO's KL estimate (TRL 1.16 ``KTOTrainer``) on its mismatched rows (each prompt with another
    row's completion, :func:`seqpar.objectives.trl_formats.kl_completions`): the metric ``"kl"``, the
    mean over sequences of the policy's minus the reference's summed completion log-prob. Run it
    under ``torch.no_grad()``; its loss is 0. KTO's ``kl`` input is its mean over the dp ranks,
    clamped at 0, as TRL gathers it."""

    name = "kto_kl"
    needs = Needs(reference=True)
    takes = Takes(per_token=("logps",))
    unit = "sequence"
    metric_names = ("kl",)

    def terms(self, q: Quantities) -> Terms:
        gap = q.sums(q.token["logps"]) - q.row["ref_logps"].to(q.token["logps"].dtype)  # [N]
        return Terms(gap.sum() * 0.0, q.seqs.count, {"kl": gap.mean()})
