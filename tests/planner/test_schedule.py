"""The dynamic SP schedule as pure functions: degrees from the token budget, bins within it, LPT
placement on aligned blocks, raising a bin's degree only when the predicted step gets shorter, and
the cost model's bin prediction."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from seqpar.comm.degrees import degree_chain
from seqpar.planner.batches import steps_by_tokens
from seqpar.planner.gain import lognormal_lengths, predict_gain
from seqpar.planner.schedule import plan_step
from seqpar.planner.work import H100, Machine, Shapes, bin_seconds, fit_degrees, fit_machine


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
    s = plan_step([[n] for n in lengths], world=4, sp=4, token_budget=8, cost=lambda d, k: _tokens(d, k) + (k > 1) * 9)
    assert set(s.rows_at_degree) == {1, 2, 4}  # a mixed schedule (static is predicted slower)
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


def test_a_degree_costs_its_measured_scale_and_fixed_cost_per_layer():
    plain = Machine(flops_per_s=1e12, bytes_per_s=1e9, collective_s=1e-4)
    assert plain.layer_overhead(1) == 0.0 and plain.layer_overhead(4) == pytest.approx(4e-4)  # 4 collectives
    assert plain.scale(4) == 1.0
    cpu = Machine(flops_per_s=1e12, bytes_per_s=1e9, collective_s=1e-4, layer_s=((4, 0.03),),
                  compute_scale=((4, 2.0),))
    assert cpu.layer_overhead(4) == 0.03 and cpu.layer_overhead(2) == pytest.approx(4e-4)
    docs = [3000, 500]
    compute = (SHAPES.linear_flops * 3500 + SHAPES.attention_flops * (3000 ** 2 + 500 ** 2)) / 1e12
    extra = bin_seconds(docs, 4, SHAPES, cpu) - bin_seconds(docs, 4, SHAPES, plain)
    assert extra == pytest.approx(compute / 4 + SHAPES.layers * (0.03 - 4e-4), rel=1e-12)
    assert bin_seconds(docs, 1, SHAPES, cpu) == bin_seconds(docs, 1, SHAPES, plain)  # degree 1 pays neither


def test_fit_degrees_recovers_each_degrees_scale_and_fixed_cost():
    true = Machine(flops_per_s=2e10, bytes_per_s=1e9, bin_s=0.02, attention_flops_per_s=5e10,
                   layer_s=((2, 0.001), (4, 0.004)), compute_scale=((2, 1.25), (4, 1.8)))
    start = Machine(flops_per_s=2e10, bytes_per_s=1e9, bin_s=0.02, attention_flops_per_s=5e10, collective_s=1e-5)
    samples = [([k * n], k, bin_seconds([k * n], k, SHAPES, true)) for k in (2, 4) for n in (512, 2048)]
    samples.append(([100], 1, 123.0))  # degree 1 is fit_machine's: ignored here
    fit = fit_degrees(samples, SHAPES, start)
    assert dict(fit.compute_scale) == pytest.approx({2: 1.25, 4: 1.8}, rel=1e-9)
    assert dict(fit.layer_s) == pytest.approx({2: 0.001, 4: 0.004}, rel=1e-6)
    for docs, k, s in samples[:-1]:
        assert bin_seconds(docs, k, SHAPES, fit) == pytest.approx(s, rel=1e-9)
    # one size per degree: its fixed cost alone, at scale 1
    one = fit_degrees(samples[:1], SHAPES, start)
    assert one.scale(2) == 1.0 and bin_seconds(*samples[0][:2], SHAPES, one) == pytest.approx(samples[0][2])
    with pytest.raises(ValueError, match="a degree above 1"):
        fit_degrees(samples[-1:], SHAPES, start)


TINY = Shapes(heads=4, kv_heads=2, head_dim=8, hidden_size=32, intermediate_size=64, layers=2, vocab_size=128,
             dtype_bytes=4)  # seqpar's tiny-llama
CPU = Machine(flops_per_s=3e9, bytes_per_s=5e8, bin_s=0.035, attention_flops_per_s=1.5e10,
              layer_s=((2, 0.002), (4, 0.006)), compute_scale=((2, 1.3), (4, 1.5)))  # 4 ranks on 2 cores


def test_fit_degrees_clamps_what_no_measurement_can_mean():
    start = replace(CPU, layer_s=(), compute_scale=())
    # faster than its compute at every size: neither a scale under 1 nor a negative fixed cost
    fast = replace(start, compute_scale=((4, 0.8),))
    samples = [([n], 4, bin_seconds([n], 4, TINY, fast) - 0.01) for n in (2048, 8192)]
    fit = fit_degrees(samples, TINY, start)
    assert dict(fit.layer_s)[4] == 0.0 and fit.scale(4) == 1.0
    # a steeper line through a negative intercept: the slope through the origin
    steep = replace(start, compute_scale=((4, 1.6),))
    samples = [([n], 4, bin_seconds([n], 4, TINY, steep) - 0.01) for n in (2048, 8192)]
    fit = fit_degrees(samples, TINY, start)
    assert dict(fit.layer_s)[4] == 0.0 and 1.0 < fit.scale(4) < 1.6
    # a falling line (noise): scale held at 1, the fixed cost from the mean
    noisy = [([1024], 4, 0.3), ([2048], 4, 0.2)]
    fit = fit_degrees(noisy, TINY, start)
    assert fit.scale(4) == 1.0 and dict(fit.layer_s)[4] > 0
    assert sum(bin_seconds(d, k, TINY, fit) - s for d, k, s in noisy) == pytest.approx(0.0, abs=1e-12)


def test_a_costly_degree_keeps_short_rows_apart_and_the_prediction_says_so():
    cost = functools.partial(bin_seconds, shapes=TINY, machine=CPU)
    lengths = (4000, 1500, 900, 700, 600, 500, 400, 300, 200, 100, 100, 80)
    dyn = plan_step([[n] for n in lengths], world=4, sp=4, token_budget=2048, cost=cost)
    static = plan_step([[n] for n in lengths], world=4, sp=4, token_budget=2048, cost=cost, degrees=(4,))
    assert dyn.rows_at_degree == {1: len(lengths) - 1, 2: 1}  # each row at the smallest degree it fits
    assert static.predicted_step_s == pytest.approx(sum(b.predicted_s for b in static.bins))
    assert dyn.predicted_step_s == pytest.approx(max(sum(b.predicted_s for b in dyn.bins_for(r)) for r in range(4)))
    assert dyn.predicted_step_s < static.predicted_step_s


def test_a_dynamic_schedule_is_never_predicted_slower_than_static():
    # few bins per step, each paying a large fixed cost: LPT cannot spread 5 bins over 8 ranks,
    # while static packs them into one bin over all 8
    def cost(docs, k):
        return sum(docs) / k + 50.0

    docs = [[2000], [1500], [1200], [900], [300]]
    dyn = plan_step(docs, world=8, sp=8, token_budget=2048, cost=cost)
    static = plan_step(docs, world=8, sp=8, token_budget=2048, cost=cost, degrees=(8,))
    greedy = plan_step(docs, world=8, sp=8, token_budget=2048, cost=cost, max_raises=0)
    assert greedy.predicted_step_s > static.predicted_step_s  # the greedy alone would lose
    assert dyn == static and dyn.rows_at_degree == {8: 5}


def test_lognormal_lengths_are_seeded_and_bounded():
    a = lognormal_lengths(2000, mean=512, cap=8192, seed=3)
    assert a == lognormal_lengths(2000, mean=512, cap=8192, seed=3) != lognormal_lengths(2000, mean=512, cap=8192,
                                                                                          seed=4)
    assert min(a) >= 16 and max(a) <= 8192 and 400 < sum(a) / len(a) < 620  # mean 512 before the cap
    with pytest.raises(ValueError, match="mean > 0"):
        lognormal_lengths(3, mean=0, cap=10, seed=0)


def test_predict_gain_sums_each_steps_two_schedules():
    cost = functools.partial(bin_seconds, shapes=TINY, machine=CPU)
    lengths = lognormal_lengths(60, mean=512, cap=8192, seed=37)
    g = predict_gain(lengths, world=4, sp=4, token_budget=2048, tokens_per_step=8192, cost=cost)
    steps = steps_by_tokens(lengths, 8192)
    plans = [(plan_step([[lengths[i]] for i in s], world=4, sp=4, token_budget=2048, cost=cost),
              plan_step([[lengths[i]] for i in s], world=4, sp=4, token_budget=2048, cost=cost, degrees=(4,)))
             for s in steps]
    assert (g.steps, g.rows, g.tokens) == (len(steps), 60, sum(lengths))
    assert g.dynamic_s == pytest.approx(sum(d.predicted_step_s for d, _ in plans), rel=1e-12)
    assert g.static_s == pytest.approx(sum(s.predicted_step_s for _, s in plans), rel=1e-12)
    assert sum(g.rows_at_degree.values()) == 60 and g.ratio <= 1.0
    same = predict_gain([8192] * 5, world=4, sp=4, token_budget=2048, tokens_per_step=8192, cost=cost)
    assert same.ratio == 1.0 and same.rows_at_degree == {4: 5}


def test_rows_that_all_need_sp_give_the_static_schedule_itself():
    cost = functools.partial(bin_seconds, shapes=TINY, machine=CPU)
    docs = [[8192], [8000], [5000, 3000], [4500]]
    dyn = plan_step(docs, world=8, sp=4, token_budget=2048, cost=cost)
    assert dyn == plan_step(docs, world=8, sp=4, token_budget=2048, cost=cost, degrees=(4,))
    assert dyn.rows_at_degree == {4: 4} and {b.first_rank for b in dyn.bins} == {0, 4}


def test_every_rank_of_a_bin_pays_for_each_of_its_documents_and_the_fit_finds_it():
    m = replace(CPU, doc_s=0.004)
    # a rank at degree 4 attends over all 12 documents (its heads): 12 x doc_s, scaled like its work
    extra = bin_seconds([512] * 12, 4, TINY, m) - bin_seconds([512] * 12, 4, TINY, CPU)
    assert extra == pytest.approx(CPU.scale(4) * 12 * 0.004, rel=1e-12)
    assert bin_seconds([512] * 3, 1, TINY, m) - bin_seconds([512] * 3, 1, TINY, CPU) == pytest.approx(0.012)
    true = Machine(flops_per_s=3e9, bytes_per_s=5e8, bin_s=0.03, attention_flops_per_s=1.5e10, doc_s=0.004)
    docs = [[512], [2048], [256] * 8, [128] * 16, [4096]]
    fit = fit_machine([(d, bin_seconds(d, 1, TINY, true)) for d in docs], TINY, bytes_per_s=5e8, collective_s=0.0)
    assert (fit.flops_per_s, fit.attention_rate, fit.doc_s, fit.bin_s) == pytest.approx(
        (3e9, 1.5e10, 0.004, 0.03), rel=1e-6)
    # the degrees' fit keeps the document term (scaled like the rest of a rank's work)
    deg = replace(true, compute_scale=((4, 1.7),), layer_s=((4, 0.01),))
    samples = [(d, 4, bin_seconds(d, 4, TINY, deg)) for d in ([2048], [256] * 8, [8192])]
    refit = fit_degrees(samples, TINY, fit)
    assert refit.scale(4) == pytest.approx(1.7, rel=1e-6) and dict(refit.layer_s)[4] == pytest.approx(0.01, rel=1e-5)
