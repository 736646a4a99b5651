"""Token-budget batches (seqpar.planner.batches): consecutive rows, each micro-step within the budget
of every rank together, steps of ``micro_steps`` micro-steps, an endless stream taken lazily, and a
row that cannot fit refused by name."""

from __future__ import annotations

import itertools
import random

import pytest

from seqpar.planner.batches import budget_steps, micro_batches, steps_by_tokens


def test_the_docstring_example():
    lengths = [300, 200, 500, 100, 400, 700, 200]
    assert list(micro_batches(lengths, world=2, token_budget=500)) == [(0, 1, 2), (3, 4), (5, 6)]
    steps = list(budget_steps(lengths, world=2, token_budget=500, micro_steps=2))
    assert [s.micro for s in steps] == [((0, 1, 2), (3, 4)), ((5, 6),)]
    assert [s.tokens for s in steps] == [1500, 900]
    assert steps[0].rows == (0, 1, 2, 3, 4)


@pytest.mark.parametrize("seed", range(5))
def test_micro_steps_are_consecutive_full_and_within_budget(seed):
    rng = random.Random(seed)
    world, budget = rng.choice([1, 2, 4]), rng.randint(5, 40)
    lengths = [rng.randint(1, world * budget) for _ in range(200)]
    micro = list(micro_batches(lengths, world=world, token_budget=budget))
    assert [i for m in micro for i in m] == list(range(len(lengths)))  # every row once, in order
    cap = world * budget
    assert all(sum(lengths[i] for i in m) <= cap for m in micro)
    for a, b in zip(micro[:-1], micro[1:], strict=True):
        assert sum(lengths[i] for i in a) + lengths[b[0]] > cap  # closed only when the next row overflows
    steps = list(budget_steps(lengths, world=world, token_budget=budget, micro_steps=3))
    assert [m for s in steps for m in s.micro] == micro
    assert all(len(s.micro) == 3 for s in steps[:-1]) and 1 <= len(steps[-1].micro) <= 3
    assert [s.tokens for s in steps] == [sum(lengths[i] for i in s.rows) for s in steps]


def test_an_endless_stream_is_read_lazily():
    pulled = []

    def stream():
        for i in itertools.count():
            pulled.append(i)
            yield 3

    first = list(itertools.islice(budget_steps(stream(), world=2, token_budget=5, micro_steps=2), 2))
    assert [s.micro for s in first] == [((0, 1, 2), (3, 4, 5)), ((6, 7, 8), (9, 10, 11))]
    assert len(pulled) == 13  # the 13th row closed the 4th micro-step


def test_a_row_too_long_names_the_token_budget():
    with pytest.raises(ValueError, match=r"row 1 has 9 tokens.*--token-budget\) to >= 5"):
        list(micro_batches([3, 9], world=4, token_budget=4, max_row=8))  # sp=2 ranks x 4 tokens
    with pytest.raises(ValueError, match="token_budget must be a positive integer"):
        list(micro_batches([3], world=2, token_budget=0))
    with pytest.raises(ValueError, match="micro_steps must be a positive integer"):
        list(budget_steps([3], world=2, token_budget=4, micro_steps=0))
    with pytest.raises(ValueError, match="row 0: a row's length must be a positive integer"):
        list(micro_batches([0], world=2, token_budget=4))


def test_steps_by_tokens_is_the_micro_steps_grouping_unchecked():
    """One grouping: where every row fits, steps of ``world x budget`` tokens are the micro-steps;
    steps_by_tokens alone lets a longer row be a step of its own (a schedule refuses it later)."""
    rng = random.Random(3)
    lengths = [rng.randint(1, 1000) for _ in range(300)]
    assert steps_by_tokens(lengths, 4 * 250) == [list(m) for m in micro_batches(lengths, world=4, token_budget=250)]
    assert steps_by_tokens([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]
