"""Advantages from rewards per prompt group (:mod:`seqpar.objectives.advantages`) against TRL 1.16's own
code path on the same numbers: ``GRPOTrainer._generate_and_score_completions`` and RLOO's, run in this
process on a tiny model whose reward functions return fixed numbers (unscorable ``None`` among them),
for every ``scale_rewards``, both multi-objective aggregations, weights, and RLOO's normalisation and
KL penalty. TRL's rewards are float32; the same float32 numbers go through seqpar's functions."""

from __future__ import annotations

import math

import pytest
import torch
from trl_fixtures import generation_trainer, prompts

from seqpar.objectives.advantages import group_advantages, nanstd, rloo_advantages

N, G = 8, 4  # two prompts, four completions each
NAN = math.nan
# two reward functions' rewards per completion; row 5 unscorable (both None), row 2 scored by one only
TABLE = [[0.5, 1.0], [0.2, NAN], [NAN, 0.3], [0.9, 0.1], [0.1, 0.7], [NAN, NAN], [0.4, 0.4], [1.5, 0.2]]


class Fixed:
    """A reward function returning column ``f`` of :data:`TABLE` (None for NaN)."""

    def __init__(self, f: int) -> None:
        self.f, self.__name__ = f, f"fixed{f}"

    def __call__(self, completions, **kwargs) -> list:
        assert len(completions) == N
        return [None if math.isnan(row[self.f]) else row[self.f] for row in TABLE]


def _batch() -> list[dict]:
    return [{"prompt": p} for p in prompts(2) for _ in range(G)]


def _rewards() -> torch.Tensor:
    return torch.tensor(TABLE, dtype=torch.float32)  # TRL's rewards_per_func: float32


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    return generation_trainer("grpo", str(tmp_path_factory.mktemp("adv")), [Fixed(0), Fixed(1)],
                              reward_weights=[1.0, 0.5])


GRPO_CASES = [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"), ("none", "sum_then_normalize"),
              ("group", "normalize_then_sum")]


@pytest.mark.parametrize("scale,aggregation", GRPO_CASES)
def test_group_advantages_equal_grpo_trainers(grpo, scale, aggregation):
    grpo.scale_rewards, grpo.multi_objective_aggregation = scale, aggregation
    want = grpo._generate_and_score_completions(_batch())["advantages"]
    groups = [i // G for i in range(N)]
    got = group_advantages(_rewards(), groups, scale_rewards=scale, weights=grpo.reward_weights,
                           aggregation=aggregation)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want), (got, want)
    assert got[5] == 0 and got.abs().sum() > 0  # the unscorable row: 0


def test_groups_need_not_be_contiguous_nor_equal():
    """The same advantages whatever the rows' order; a ragged group's statistics are its own."""
    r = torch.tensor([0.1, 0.9, 0.4, 0.7, 0.3], dtype=torch.float64)
    groups = ["a", "b", "a", "b", "a"]
    got = group_advantages(r, groups)
    a, b = r[[0, 2, 4]], r[[1, 3]]
    want = torch.empty(5, dtype=torch.float64)
    want[[0, 2, 4]] = (a - a.mean()) / (a.std() + 1e-4)
    want[[1, 3]] = (b - b.mean()) / (b.std() + 1e-4)
    assert torch.allclose(got, want, rtol=0, atol=1e-15)
    perm = [3, 0, 4, 1, 2]
    assert torch.allclose(group_advantages(r[perm], [groups[i] for i in perm]), got[perm], rtol=0, atol=1e-15)
    assert float(nanstd(torch.tensor([1.0, NAN, 3.0]))) == pytest.approx(math.sqrt(2.0))


@pytest.fixture(scope="module")
def rloo(tmp_path_factory):
    return generation_trainer("rloo", str(tmp_path_factory.mktemp("rloo")), [Fixed(0), Fixed(1)],
                              reward_weights=[1.0, 0.5], beta=0.0)


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_advantages_equal_rloo_trainers(rloo, normalize):
    rloo.normalize_advantages = normalize  # RLOOConfig(normalize_advantages=...) as the trainer reads it
    want = rloo._generate_and_score_completions(_batch())["advantages"]
    got = rloo_advantages(_rewards(), [i // G for i in range(N)], weights=rloo.reward_weights, normalize=normalize)
    assert torch.equal(got, want), (got, want)


def test_rloo_kl_penalty_is_trls(rloo):
    """beta != 0: TRL subtracts beta x (each completion's summed old - ref log-probs) from the reward."""
    from trl.trainer.utils import add_fused_lm_head
    from trl_fixtures import tiny_lm

    rloo.normalize_advantages = False
    rloo.beta, rloo.ref_model = 0.2, tiny_lm(seed=5)  # a reference other than the policy: the penalty is not 0
    add_fused_lm_head(rloo.ref_model)  # as TRL does to the reference it builds itself
    try:
        out = rloo._generate_and_score_completions(_batch())
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        c = out["completion_ids"].shape[1]
        with torch.no_grad():
            pol, _, _ = rloo._get_per_token_logps_and_entropies(rloo.model, ids, mask, c)
            ref, _, _ = rloo._get_per_token_logps_and_entropies(rloo.ref_model, ids, mask, c)
    finally:
        rloo.beta, rloo.ref_model = 0.0, None
    kl = ((pol - ref) * out["completion_mask"]).sum(-1)
    got = rloo_advantages(_rewards(), [i // G for i in range(N)], weights=rloo.reward_weights, kl=kl, beta=0.2)
    assert kl.abs().max() > 1e-2 and torch.equal(got, out["advantages"]), (got, out["advantages"])


def test_bad_options_are_value_errors():
    r = torch.zeros(4)
    with pytest.raises(ValueError, match="scale_rewards='std'"):
        group_advantages(r, [0, 0, 1, 1], scale_rewards="std")
    with pytest.raises(ValueError, match="one group id per row"):
        group_advantages(r, [0, 0, 1])
    with pytest.raises(ValueError, match="weights has 2 entries for 1"):
        group_advantages(r, [0, 0, 1, 1], weights=torch.ones(2))
    with pytest.raises(ValueError, match="give kl"):
        rloo_advantages(r, [0, 0, 1, 1], beta=0.1)
