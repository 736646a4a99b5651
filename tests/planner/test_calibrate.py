"""The cost model's probes (pure): every probe fits the per-rank budget at its degree and holds whole
pairs (an even number of documents); fitted to times a known machine would take, they give that
machine's constants back."""

from __future__ import annotations

import pytest

from seqpar.planner.calibrate import MIN_MEASURED_BUDGET, Measured, probe_bins
from seqpar.planner.work import Machine, Shapes, bin_seconds

SHAPES = Shapes(heads=4, kv_heads=2, head_dim=32, hidden_size=128, intermediate_size=256, layers=2, vocab_size=259,
                dtype_bytes=4)


@pytest.mark.parametrize("budget", [MIN_MEASURED_BUDGET, 37, 2048])
def test_probes_fit_the_budget_and_hold_pairs(budget):
    probes = probe_bins(budget, (1, 2, 4))
    assert {k for _, k in probes} == {1, 2, 4}
    for docs, k in probes:
        assert len(docs) % 2 == 0 and min(docs) >= 1, (docs, k)
        assert -(-sum(docs) // k) <= budget, (docs, k, budget)  # a shard the budget holds
        assert sum(docs) >= k  # every rank gets a token


def test_a_known_machine_is_fitted_back():
    truth = Machine(flops_per_s=8e9, attention_flops_per_s=2e10, bytes_per_s=1e8, bin_s=0.02, doc_s=3e-4,
                    layer_s=((2, 0.011), (4, 0.023)), compute_scale=((2, 1.2), (4, 1.5)))
    samples = [(docs, k, bin_seconds(docs, k, SHAPES, truth)) for docs, k in probe_bins(2048, (1, 2, 4))]
    got = Measured(samples, bytes_per_s=truth.bytes_per_s, collective_s=0.0).machine(SHAPES)
    for name in ("flops_per_s", "attention_flops_per_s", "bin_s", "doc_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    for (k, s), (_, s_true) in zip(got.compute_scale, truth.compute_scale, strict=True):
        assert s == pytest.approx(s_true, rel=1e-6), k
    for (k, f), (_, f_true) in zip(got.layer_s, truth.layer_s, strict=True):
        assert f == pytest.approx(f_true, rel=1e-6), k
