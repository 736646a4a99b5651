"""Each objective's declared ``metric_names`` are the metrics its ``terms`` returns (pure: stand-in
quantities of 4 sequences, 2 interleaved pairs): ``seqpar train`` sums them over every rank by
these names, on ranks that ran no batch too."""

from types import SimpleNamespace

import pytest
import torch

from seqpar.objectives import DPO, ORPO, BradleyTerry, CausalLM, PolicyGradient, SimPO


def _quantities() -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(4, 6, generator=g, dtype=torch.float64)  # [N, S] token log-probs, all < 0
    return SimpleNamespace(token={"logps": logps}, counts=torch.full((4,), 6.0, dtype=torch.float64),
                           row={"ref_logps": -torch.rand(4, generator=g, dtype=torch.float64) * 6,
                                "score": torch.randn(4, 1, generator=g, dtype=torch.float64)},
                           sums=lambda x: x.sum(-1))


@pytest.mark.parametrize("objective", [DPO(loss_type=["sigmoid", "ipo"], pairing="interleaved"),
                                       SimPO(pairing="interleaved"), ORPO(pairing="interleaved"),
                                       BradleyTerry(pairing="interleaved")], ids=lambda o: o.name)
def test_metric_names_are_the_metrics_terms_returns(objective):
    terms = objective.terms(_quantities())
    assert objective.metric_names and list(terms.metrics) == list(objective.metric_names)
    assert terms.count == 2  # the metrics are means over these 2 pairs: weighed by count, they add up


def test_a_token_mean_has_no_metrics():
    assert CausalLM.metric_names == ()


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_the_policy_loss_declares_its_kl_metric_where_it_has_one(beta):
    g = torch.Generator().manual_seed(1)
    q = _quantities()
    q.token.update(entropy=torch.rand(4, 6, generator=g, dtype=torch.float64),
                   advantages=torch.randn(4, 6, generator=g, dtype=torch.float64),
                   ref_logps=-torch.rand(4, 6, generator=g, dtype=torch.float64))
    q.seqs = SimpleNamespace(count=4)
    objective = PolicyGradient(loss_type="grpo", beta=beta)
    assert list(objective.terms(q).metrics) == sorted(objective.metric_names, key=["kl", "clip_ratio",
                                                                                    "entropy"].index)
    assert ("kl" in objective.metric_names) == (beta != 0)
