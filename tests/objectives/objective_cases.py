"""The objective parity grid: per objective, its seqpar definition, its inputs and its float64 oracle
(TRL 1.16's formulas restated on the unsharded model's per-sequence terms, see
:mod:`seqpar.testing.objective_oracle`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from seqpar import objectives as O
from seqpar.testing.objective_oracle import SeqTerms, token_input


@dataclass(frozen=True)
class Case:
    objective: str
    batch: str = "padded"  # padded / packed
    p: int = 2
    seq: int = 13
    reference: str = "none"  # none / frozen / column / adapters_off
    layout: str = "contiguous"
    prompt: int = 3  # leading tokens of each sequence without a label (0: a left-padded row's first real
    # token has one, which a padding position would predict: seqpar's rule leaves it out)


def _sums(t: SeqTerms) -> tuple[Tensor, Tensor]:
    return torch.stack([x.sum() for x in t.logps]), torch.stack([m.sum() for m in t.mask]).to(torch.float64)


def _halves(x: Tensor) -> tuple[Tensor, Tensor]:
    return x[: x.shape[0] // 2], x[x.shape[0] // 2:]


def _dpo(kind: str, beta: float, ls: float, c: Tensor, r: Tensor, cr: Tensor, rr: Tensor, nc: Tensor, nr: Tensor,
         chosen_tok: tuple[Tensor, Tensor]) -> Tensor:
    """TRL 1.16 DPOTrainer._compute_loss, per pair."""
    cl, rl = c - cr, r - rr
    d = cl - rl
    if kind == "sigmoid":
        return -F.logsigmoid(beta * d)
    if kind == "hinge":
        return torch.relu(1 - beta * d)
    if kind == "ipo":
        return (cl / nc.clamp(min=1) - rl / nr.clamp(min=1) - 1 / (2 * beta)) ** 2
    if kind == "exo_pair":
        eps = torch.tensor(ls, dtype=torch.float64)
        return (torch.sigmoid(beta * d) * (F.logsigmoid(beta * d) - torch.log1p(-eps))
                + torch.sigmoid(-beta * d) * (F.logsigmoid(-beta * d) - torch.log(eps)))
    if kind == "nca_pair":
        return -F.logsigmoid(beta * cl) - 0.5 * F.logsigmoid(-beta * cl) - 0.5 * F.logsigmoid(-beta * rl)
    if kind == "robust":
        return (-(1 - ls) * F.logsigmoid(beta * d) - (-ls * F.logsigmoid(-beta * d))) / (1 - 2 * ls)
    if kind == "bco_pair":
        return -F.logsigmoid(beta * cl) - F.logsigmoid(-beta * rl)
    if kind == "sppo_hard":
        return (cl - 0.5 / beta) ** 2 + (rl + 0.5 / beta) ** 2
    if kind == "aot":
        dd = torch.sort(c - r)[0] - torch.sort(cr - rr)[0]
        return -F.logsigmoid(beta * dd) * (1 - ls) - F.logsigmoid(-beta * dd) * ls
    if kind == "aot_unpaired":
        dd = torch.sort(cl)[0] - torch.sort(rl)[0]
        return -F.logsigmoid(beta * dd) * (1 - ls) - F.logsigmoid(-beta * dd) * ls
    if kind == "apo_zero":
        return (1 - torch.sigmoid(beta * cl)) + torch.sigmoid(beta * rl)
    if kind == "apo_down":
        return torch.sigmoid(beta * cl) + (1 - torch.sigmoid(beta * (cl - rl)))
    if kind == "discopop":
        z = d * beta
        m = torch.sigmoid(z / 0.05)
        return -F.logsigmoid(z) * (1 - m) + torch.exp(-z) * m
    if kind == "sft":
        return (-chosen_tok[0] / chosen_tok[1]).expand(c.shape[0])
    if kind == "sigmoid_norm":
        return -F.logsigmoid(beta * (cl / nc.clamp(min=1) - rl / nr.clamp(min=1)))
    raise AssertionError(kind)


def dpo_oracle(types: list[str], weights: list[float], beta: float, ls: float) -> Callable[..., Tensor]:
    def oracle(t: SeqTerms, ref: Tensor, inputs: dict[str, Tensor]) -> Tensor:
        lp, n = _sums(t)
        (c, r), (cr, rr), (nc, nr) = _halves(lp), _halves(ref), _halves(n)
        tok = (c.sum(), nc.sum())
        return sum(w * _dpo(k, beta, ls, c, r, cr, rr, nc, nr, tok).mean() for k, w in zip(types, weights, strict=True))
    return oracle


def simpo_oracle(t: SeqTerms, ref: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    lp, n = _sums(t)
    c, r = _halves(lp / n)  # CPOTrainer's average_log_prob
    z = 2.0 * (c - r) - 0.5  # beta * (logits - gamma / beta)
    return (-F.logsigmoid(z)).mean()


def orpo_oracle(t: SeqTerms, ref: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    lp, n = _sums(t)
    (cs, _), (nc, _) = _halves(lp), _halves(n)
    c, r = _halves(lp / n)

    def log1mexp(x: Tensor) -> Tensor:
        return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))

    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    return -cs.sum() / nc.sum() - (0.1 * F.logsigmoid(log_odds)).mean()


def kto_oracle(t: SeqTerms, ref: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    lp, _ = _sums(t)
    ratio, kl, good = lp - ref, inputs["kl"].clamp(min=0), inputs["desirable"].bool()
    up = 1 - torch.sigmoid(0.1 * (ratio - kl))
    down = 1 - torch.sigmoid(0.1 * (kl - ratio))
    return torch.cat([1.0 * up[good], 1.33 * down[~good]]).mean()


def grpo_oracle(loss_type: str, beta: float = 0.0) -> Callable[..., Tensor]:
    """TRL 1.16 GRPOTrainer._compute_loss (token-level importance sampling, epsilon 0.2 / 0.28)."""
    def oracle(t: SeqTerms, ref_tok: Any, inputs: dict[str, Tensor]) -> Tensor:
        rows, tot, n_all = [], 0.0, 0.0
        for k, (lp, m) in enumerate(zip(t.logps, t.mask, strict=True)):
            old = token_input(inputs["old_logps"], t, k)
            coef_1 = torch.exp(lp - old)
            coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
            a = inputs["advantages"][k]
            ptl = -torch.min(coef_1 * a, coef_2 * a)
            if beta:
                ref = ref_tok[k]
                ptl = ptl + beta * (torch.exp(ref - lp) - (ref - lp) - 1) * coef_1  # use_bias_correction_kl
            rows.append((ptl * m).sum() / m.sum().clamp(min=1))
            tot = tot + (ptl * m).sum()
            n_all += float(m.sum())
        if loss_type == "grpo":
            return torch.stack(rows).mean()
        if loss_type == "dr_grpo":
            return tot / (len(rows) * 16)
        return tot / n_all  # bnpo, dapo: token-mean
    return oracle


def bt_oracle(t: SeqTerms, ref: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    c, r = _halves(torch.stack([s[0] for s in t.score]))
    loss = -F.logsigmoid(c - r - inputs["margin"]).mean()
    return loss + 0.01 * torch.mean((c + r) ** 2)


def cls_oracle(t: SeqTerms, ref: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(torch.stack(t.score), inputs["labels"])


def reg_oracle(t: SeqTerms, ref: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    return F.mse_loss(torch.stack([s[0] for s in t.score]), inputs["labels"])


def value_oracle(t: SeqTerms, ref: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    tot, n = 0.0, 0.0
    for k, (v, m) in enumerate(zip(t.values, t.mask, strict=True)):
        ret, old = token_input(inputs["returns"], t, k), token_input(inputs["old_values"], t, k)
        err = torch.max((v - ret) ** 2, (torch.clamp(v, old - 0.2, old + 0.2) - ret) ** 2)
        tot, n = tot + (err * m).sum(), n + float(m.sum())
    return 0.5 * tot / n


def sft_oracle(t: SeqTerms, ref: Tensor, inputs: dict[str, Tensor]) -> Tensor:
    lp, n = _sums(t)
    return -lp.sum() / n.sum()


ALL_DPO = list(O.DPO_LOSSES)
DPO_WEIGHTS = [1.0 + 0.1 * i for i in range(len(ALL_DPO))]

# name -> (objective, model kind, oracle, inputs it needs)
OBJECTIVES: dict[str, tuple[Callable[[], O.Objective], str, Callable[..., Tensor], tuple[str, ...]]] = {
    "dpo-sigmoid": (lambda: O.DPO(beta=0.1), "lm", dpo_oracle(["sigmoid"], [1.0], 0.1, 0.0), ()),
    "dpo-all": (lambda: O.DPO(beta=0.1, loss_type=ALL_DPO, loss_weights=DPO_WEIGHTS, label_smoothing=0.1), "lm",
                dpo_oracle(ALL_DPO, DPO_WEIGHTS, 0.1, 0.1), ()),
    "simpo": (lambda: O.SimPO(beta=2.0, gamma=0.5), "lm", simpo_oracle, ()),
    "orpo": (lambda: O.ORPO(beta=0.1), "lm", orpo_oracle, ()),
    "kto": (lambda: O.KTO(beta=0.1, undesirable_weight=1.33), "lm", kto_oracle, ("desirable", "kl")),
    "grpo": (lambda: O.PolicyGradient(loss_type="grpo", epsilon_high=0.28), "lm", grpo_oracle("grpo"),
             ("advantages", "old_logps")),
    "dr_grpo": (lambda: O.PolicyGradient(loss_type="dr_grpo", epsilon_high=0.28, max_completion_length=16), "lm",
                grpo_oracle("dr_grpo"), ("advantages", "old_logps")),
    "bnpo-kl": (lambda: O.PolicyGradient(loss_type="bnpo", epsilon_high=0.28, beta=0.04), "lm",
                grpo_oracle("bnpo", beta=0.04), ("advantages", "old_logps")),
    "dapo": (lambda: O.PolicyGradient(loss_type="dapo", epsilon_high=0.28), "lm", grpo_oracle("dapo"),
             ("advantages", "old_logps", "num_units")),
    "bradley_terry": (lambda: O.BradleyTerry(center_rewards_coefficient=0.01), "score1", bt_oracle, ("margin",)),
    "classification": (lambda: O.SequenceClassification(), "score3", cls_oracle, ("labels3",)),
    "regression": (lambda: O.SequenceClassification(), "score1", reg_oracle, ("labels1",)),
    "value": (lambda: O.ValueLoss(clip=0.2), "score1", value_oracle, ("returns", "old_values")),
    "sft": (lambda: O.CausalLM(), "lm", sft_oracle, ()),
}
NEEDS_REFERENCE = {"dpo-sigmoid", "dpo-all", "kto", "bnpo-kl"}


def make_inputs(names: tuple[str, ...], batch: dict[str, Tensor], n: int, seed: int) -> dict[str, Any]:
    """The inputs a case needs, whole (every rank draws the same)."""
    g = torch.Generator().manual_seed(seed)
    shape = batch["input_ids"].shape
    draw = {
        "desirable": lambda: torch.tensor([i % 3 != 1 for i in range(n)]),
        "kl": lambda: torch.tensor(0.05, dtype=torch.float64),
        "advantages": lambda: torch.randn(n, generator=g, dtype=torch.float64),
        "old_logps": lambda: 0.15 * torch.randn(shape, generator=g, dtype=torch.float64),  # + the policy's own
        "margin": lambda: torch.rand(n // 2, generator=g, dtype=torch.float64),
        "labels3": lambda: torch.randint(0, 3, (n,), generator=g),
        "labels1": lambda: torch.randn(n, generator=g, dtype=torch.float64),
        "returns": lambda: torch.randn(shape, generator=g, dtype=torch.float64),
        "old_values": lambda: torch.randn(shape, generator=g, dtype=torch.float64) * 0.3,
    }
    return {("labels" if name.startswith("labels") else name): draw[name]() for name in names if name in draw}
