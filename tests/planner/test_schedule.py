"""The dynamic SP schedule as pure functions: degrees from the token budget, bins within it, LPT
placement on aligned blocks, raising a bin's degree only when the predicted step gets shorter, and
the cost model's bin prediction."""

from __future__ import annotations

import pytest

from seqpar.comm.degrees import degree_chain
from seqpar.planner.schedule import plan_step, steps_by_tokens
from seqpar.planner.work import H100, Machine, Shapes, bin_seconds, fit_machine


def _tokens(docs, k):
    return sum(docs) / k + (5.0 if k > 1 else 0.0)


def test_degree_chain_each_divides_the_next():
    assert degree_chain(1) == (1,)
    assert degree_chain(8) == (1, 2, 4, 8)
    assert degree_chain(6) == (1, 2, 6)
    assert degree_chain(12) == (1, 2, 4, 12)
    with pytest.raises(ValueError, match="sp must be a positive integer"):
        degree_chain(0)


def test_every_row_in_exactly_one_bin_within_the_budget_at_its_smallest_degree():
    lengths = [3, 17, 8, 9, 30, 1, 16, 5, 12]
    s = plan_step([[n] for n in lengths], world=4, sp=4, token_budget=8, cost=_tokens, max_raises=0)
    seen = sorted(i for b in s.bins for i in b.rows)
    assert seen == list(range(len(lengths)))
    for b in s.bins:
        assert b.tokens == sum(lengths[i] for i in b.rows)
        assert -(-b.tokens // b.degree) <= 8  # per-rank shard within the budget
        for i in b.rows:  # the smallest degree whose shard fits
            assert b.degree == min(k for k in (1, 2, 4) if -(-lengths[i] // k) <= 8)
        assert b.first_rank % b.degree == 0 and b.first_rank + b.degree <= 4  # an aligned block
    need = [min(k for k in (1, 2, 4) if -(-n // k) <= 8) for n in lengths]
    assert s.rows_at_degree == {k: need.count(k) for k in set(need)}


def test_execution_order_is_by_degree_and_predictions_add_up():
    lengths = [3, 17, 8, 9, 30, 1, 16, 5, 12, 7, 7, 2]
    s = plan_step([[n] for n in lengths], world=4, sp=4, token_budget=8, cost=_tokens)
    assert [b.degree for b in s.bins] == sorted((b.degree for b in s.bins), reverse=True)
    for r in range(4):
        assert s.predicted_rank_s[r] == pytest.approx(sum(b.predicted_s for b in s.bins_for(r)))
        assert all(r in b.ranks for b in s.bins_for(r))
    assert s.predicted_step_s == max(s.predicted_rank_s)
    assert "rows at sp=1:" in s.describe()


def test_lpt_balances_equal_bins_over_the_ranks():
    s = plan_step([[8]] * 8, world=4, sp=4, token_budget=8, cost=_tokens)
    assert s.predicted_rank_s == (16.0, 16.0, 16.0, 16.0)
    assert [len(s.bins_for(r)) for r in range(4)] == [2, 2, 2, 2]


def test_a_bin_is_raised_when_it_alone_sets_the_step_time():
    # one 8-token row and nothing else: at degree 1 one rank works 8 while three idle; at 4, 2 + 5 = 7
    raised = plan_step([[8]], world=4, sp=4, token_budget=8, cost=_tokens)
    assert [b.degree for b in raised.bins] == [4] and raised.predicted_step_s == 7.0
    kept = plan_step([[8]], world=4, sp=4, token_budget=8, cost=_tokens, max_raises=0)
    assert [b.degree for b in kept.bins] == [1] and kept.predicted_step_s == 8.0
    # many small rows: raising never pays, every rank works at degree 1
    many = plan_step([[4]] * 16, world=4, sp=4, token_budget=8, cost=_tokens)
    assert {b.degree for b in many.bins} == {1} and many.predicted_step_s == 16.0


def test_static_schedule_is_the_full_degree_only():
    s = plan_step([[3], [17], [8]], world=4, sp=4, token_budget=8, cost=_tokens, degrees=(4,))
    assert {b.degree for b in s.bins} == {4} and s.rows_at_degree == {4: 3}
    assert s.bins[0].tokens == 28  # all three in one bin of 4 x 8 tokens


def test_dp_blocks_stay_inside_their_sp_group():
    s = plan_step([[30], [30], [16], [16]], world=8, sp=4, token_budget=8, cost=_tokens)
    for b in s.bins:
        assert b.first_rank // 4 == (b.first_rank + b.degree - 1) // 4


@pytest.mark.parametrize("kw, match", [
    (dict(docs=[[40]], token_budget=8), "raise the token budget .--token-budget. to >= 10"),
    (dict(docs=[[0]], token_budget=8), "document lengths must be positive"),
    (dict(docs=[[4]], token_budget=0), "token_budget must be a positive integer"),
    (dict(docs=[[4]], token_budget=8, degrees=(3,)), "must be taken from"),
])
def test_bad_input_names_what_to_change(kw, match):
    with pytest.raises(ValueError, match=match):
        plan_step(world=4, sp=4, cost=_tokens, **kw)


def test_steps_by_tokens_groups_rows_up_to_the_budget():
    assert steps_by_tokens([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]
    with pytest.raises(ValueError, match="tokens_per_step"):
        steps_by_tokens([1], 0)


SHAPES = Shapes(heads=32, kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=14336, layers=32,
                vocab_size=128256)


def test_cost_model_attention_is_quadratic_and_comm_only_above_degree_one():
    m = Machine(flops_per_s=1e12, bytes_per_s=1e9)
    one = bin_seconds([1000], 1, SHAPES, m)
    assert one == pytest.approx((SHAPES.linear_flops * 1000 + SHAPES.attention_flops * 1e6) / 1e12)
    # packing two documents costs their own attention, not the joint square
    assert bin_seconds([500, 500], 1, SHAPES, m) < one
    two = bin_seconds([1000], 2, SHAPES, m)
    assert two > one / 2  # the all-to-all bytes are paid at degree 2
    assert bin_seconds([131072], 8, SHAPES, H100) < bin_seconds([131072], 1, SHAPES, H100)


def test_fit_machine_recovers_the_constants():
    true = Machine(flops_per_s=2e10, bytes_per_s=1e9, collective_s=1e-3, bin_s=0.02)
    samples = [([n], bin_seconds([n], 1, SHAPES, true)) for n in (100, 400, 1600)]
    fit = fit_machine(samples, SHAPES, bytes_per_s=1e9, collective_s=1e-3)
    assert fit.flops_per_s == pytest.approx(2e10, rel=1e-9) and fit.bin_s == pytest.approx(0.02, rel=1e-6)
    attn = Machine(flops_per_s=2e10, bytes_per_s=1e9, bin_s=0.02, attention_flops_per_s=5e10)
    three = [([n], bin_seconds([n], 1, SHAPES, attn)) for n in (100, 400, 8192)]
    fit = fit_machine(three, SHAPES, bytes_per_s=1e9, collective_s=0.0)
    assert fit.flops_per_s == pytest.approx(2e10, rel=1e-6) and fit.attention_rate == pytest.approx(5e10, rel=1e-6)
    with pytest.raises(ValueError, match="two bins of different sizes"):
        fit_machine(samples[:1], SHAPES, bytes_per_s=1e9, collective_s=1e-3)
