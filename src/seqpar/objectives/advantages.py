"""Advantages from rewards, per prompt group, as TRL 1.16 computes them from its generation batch
(``GRPOTrainer._generate_and_score_completions``, ``RLOOTrainer``'s): pure functions on the rewards
of the rows given (TRL: the whole generation batch, every process's completions).

    rewards    [N] one per completion, or [N, F] one per reward function (weighted by ``weights``:
               :func:`weighted_rewards`);
               NaN: unscorable (every reward function returned None): left out of its group's
               statistics, its advantage 0
    groups     [N] the group of each completion (the completions of one prompt); groups need not be
               contiguous nor of equal sizes (TRL's are: num_generations in a row)

GRPO (``multi_objective_aggregation="sum_then_normalize"``, TRL's default)::

    r = sum_f w_f * rewards[:, f]                     (NaN where every function is NaN)
    A = r - mean_group(r)                             scale_rewards="none"   (Dr. GRPO)
    A = (r - mean_group(r)) / (std_group(r) + eps)    scale_rewards="group"  (GRPO, DAPO)
    A = (r - mean_group(r)) / (std_batch(r) + eps)    scale_rewards="batch"

``"normalize_then_sum"``: each function's rewards normalised per group, summed with the weights, then
the sum normalised over the rows. std is Bessel-corrected (TRL's ``nanstd``), eps = 1e-4. DAPO and Dr.
GRPO differ from GRPO in the loss, not here: DAPO's token-mean aggregation and clip-higher
(:class:`~seqpar.objectives.rl.PolicyGradient` ``loss_type="dapo"``, ``epsilon_high``), Dr. GRPO's
``scale_rewards="none"`` with ``loss_type="dr_grpo"``.

RLOO (:func:`rloo_advantages`): the leave-one-out baseline, ``A_i = r_i - mean_{j != i in group} r_j``,
optionally normalised over the rows; TRL subtracts ``beta * KL`` from the reward first (the sequence's
sum of ``old_logp - ref_logp``), which the caller does.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
EPS = 1e-4  # TRL's, added to the std


def nanstd(x: Tensor) -> Tensor:
    """The Bessel-corrected standard deviation of ``x`` over its non-NaN entries (NaN for fewer than
    two), as TRL's ``nanstd`` over all dimensions."""
    mean = torch.nanmean(x, dim=0, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=0, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=0, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    return torch.sqrt(variance * correction).squeeze(0)


def group_index(groups: Tensor | list) -> list[Tensor]:
    """The row indices of each group ``[n_g]``, groups in order of first appearance. ``groups``: a
    tensor of ids, or a list of hashable ids (prompt texts...)."""
    keys = groups.tolist() if isinstance(groups, Tensor) else list(groups)
    members: dict[object, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    return [torch.tensor(rows, dtype=torch.long) for rows in members.values()]


def _per_group(values: Tensor, index: list[Tensor], fn) -> Tensor:
    """``fn`` over each group's values ``[n_g, ...]``, broadcast back to its rows ``[N, ...]``."""
    out = torch.empty_like(values)
    for rows in index:
        out[rows] = fn(values[rows]).expand_as(values[rows])
    return out


def _check(rewards: Tensor, groups: Tensor | list, scale_rewards: str, aggregation: str) -> None:
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: choose from {list(SCALE_REWARDS)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation={aggregation!r}: choose from {list(AGGREGATIONS)}")
    if rewards.dim() not in (1, 2) or rewards.shape[0] != len(groups):
        raise ValueError(f"rewards must be [N] or [N, F] with one group id per row: got {list(rewards.shape)} "
                         f"rewards for {len(groups)} group ids")


def _per_func(rewards: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(rewards [N, F], weights [F])`` (default weights: ones)."""
    per_func = rewards if rewards.dim() == 2 else rewards[:, None]  # [N, F]
    w = torch.ones(per_func.shape[1], dtype=per_func.dtype) if weights is None else weights.to(per_func.dtype)
    if w.shape != (per_func.shape[1],):
        raise ValueError(f"weights has {w.numel()} entries for {per_func.shape[1]} reward functions")
    return per_func, w


def weighted_rewards(rewards: Tensor, weights: Tensor | None = None) -> Tensor:
    """``sum_f w_f * rewards[:, f]`` ``[N]``, NaN where every function is NaN (unscorable)."""
    per_func, w = _per_func(rewards, weights)
    r = (per_func * w[None]).nansum(dim=1)
    r[torch.isnan(per_func).all(dim=1)] = torch.nan
    return r


def group_advantages(rewards: Tensor, groups: Tensor | list, *, scale_rewards: str = "group",
                     weights: Tensor | None = None, aggregation: str = "sum_then_normalize",
                     eps: float = EPS) -> Tensor:
    """GRPO's advantages ``[N]`` (see the module doc) of ``rewards`` ``[N]`` or ``[N, F]`` grouped by
    ``groups``; ``weights`` ``[F]`` (default ones). ValueError for an unknown option or mismatched shapes."""
    _check(rewards, groups, scale_rewards, aggregation)
    per_func, w = _per_func(rewards, weights)
    index = group_index(groups)
    unscorable = torch.isnan(per_func).all(dim=1)  # [N]
    if aggregation == "sum_then_normalize":
        r = weighted_rewards(per_func, w)
        mean = _per_group(r, index, torch.nanmean)
        if scale_rewards == "batch":
            std = nanstd(r).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
        else:  # "none" keeps it for nothing (TRL logs its zero-std fraction)
            std = _per_group(r, index, nanstd)
        adv = r - mean
        if scale_rewards != "none":
            adv = adv / (std + eps)
    else:
        mean_k = _per_group(per_func, index, lambda x: torch.nanmean(x, dim=0, keepdim=True))
        std_k = _per_group(per_func, index, lambda x: nanstd(x)[None])
        r = (((per_func - mean_k) / (std_k + eps)) * w[None]).nansum(dim=1)
        r[unscorable] = torch.nan
        std = nanstd(r).expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
        adv = (r - torch.nanmean(r)) / (std + eps)
    return torch.nan_to_num(adv, nan=0.0)


def rloo_advantages(rewards: Tensor, groups: Tensor | list, *, weights: Tensor | None = None,
                    normalize: bool = False, kl: Tensor | None = None, beta: float = 0.0, eps: float = EPS) -> Tensor:
    """RLOO's leave-one-out advantages ``[N]`` of ``rewards`` ``[N]`` or ``[N, F]`` (weighted by
    ``weights``; NaN: unscorable, left out of its siblings' baselines, advantage 0), after TRL's KL
    penalty ``rewards - beta * kl`` (``kl`` ``[N]``: each completion's summed ``old - ref`` log-probs);
    ``normalize``: then ``(A - mean) / (std + eps)`` over the rows (TRL's ``normalize_advantages``)."""
    _check(rewards, groups, "group", "sum_then_normalize")
    rewards = weighted_rewards(rewards, weights)
    if beta != 0.0:
        if kl is None or kl.shape != rewards.shape:
            raise ValueError(f"beta={beta} subtracts beta * kl from the rewards: give kl, one per completion")
        rewards = rewards - beta * kl.to(rewards.dtype)
    adv = torch.empty_like(rewards)
    for rows in group_index(groups):
        r = rewards[rows]
        if rows.numel() > 1:
            scorable = (~torch.isnan(r)).sum()
            adv[rows] = r - (torch.nansum(r) - r) / (scorable - 1)
        else:
            adv[rows] = torch.zeros_like(r)  # TRL: no baseline for a single completion
    if normalize:
        adv = (adv - torch.nanmean(adv)) / (nanstd(adv) + eps)
    return torch.nan_to_num(adv, nan=0.0)
