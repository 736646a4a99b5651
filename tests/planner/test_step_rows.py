"""A dynamic step reads each row's tokens once (``DynamicSP.plan``): the documents, the step's targets
and the bins' packed rows come from them. The shortcuts it takes give what the row-by-row definitions
give: a row without position ids is one document (no restarts looked for), and the step's targets
are counted over its rows packed into one row (each row's positions start at 0, so no row predicts
the next one's first token). Pure: no process group."""

from __future__ import annotations

import functools

import torch

from seqpar.batch.sharding import count_target_tokens
from seqpar.planner.bins import _documents, _targets, pack_rows, row_documents, row_tokens, step_targets
from seqpar.planner.gain import lognormal_lengths
from seqpar.planner.schedule import plan_step
from seqpar.planner.work import H100, Shapes, bin_seconds


def _rows(seed: int) -> list[dict]:
    """Plain, padded (left and right), packed, unlabelled and all-ignored rows, seeded."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lognormal_lengths(24, mean=40, cap=200, seed=seed, floor=2)):
        ids = torch.randint(0, 50, (n,), generator=g)
        row = {"input_ids": ids, "labels": ids.clone()}
        kind = i % 6
        if kind in (1, 2):  # padding: the last (right) or first (left) third
            mask = torch.ones(n, dtype=torch.long)
            cut = max(1, n // 3)
            if kind == 1:
                mask[n - cut:] = 0
            else:
                mask[:cut] = 0
            row["attention_mask"] = mask
            row["labels"][mask == 0] = -100
        if kind == 3:  # packed documents, one of them a single token
            cut = n // 2
            row["position_ids"] = torch.cat([torch.arange(cut), torch.arange(1), torch.arange(n - cut - 1)])
        if kind == 4:
            row["labels"] = torch.full_like(ids, -100)
        if kind == 5 and i % 12 == 5:
            del row["labels"]
        rows.append(row)
    return rows


def _split(row) -> list[int]:  # the documents by their definition: split wherever the positions restart
    pos = row_tokens(row)[2]
    starts = [0, *((torch.diff(pos) != 1).nonzero().flatten() + 1).tolist(), pos.numel()]
    return [b - a for a, b in zip(starts[:-1], starts[1:], strict=True) if b > a]


def test_documents_and_targets_read_once_equal_the_row_by_row_definitions():
    for seed in range(5):
        rows = _rows(seed)
        tokens = [row_tokens(r) for r in rows]
        assert [_documents(t, "position_ids" in r) for t, r in zip(tokens, rows, strict=True)] \
            == [row_documents(r) for r in rows] == [_split(r) for r in rows]
        by_row = float(count_target_tokens([pack_rows([r]) for r in rows if "labels" in r]))
        assert _targets(tokens, -100) == step_targets(rows) == by_row > 0


def test_the_benchmarks_steps_plan_the_same_bins_from_the_documents_read_once():
    """The schedule depends on the rows only through their documents: 20 seeded steps of the
    benchmark's lengths (lognormal, mean 512, cap 8192) plan the same bins either way."""
    shapes = Shapes(heads=4, kv_heads=2, head_dim=8, hidden_size=32, intermediate_size=64, layers=2, vocab_size=128)
    cost = functools.partial(bin_seconds, shapes=shapes, machine=H100)
    for seed in range(20):
        rows = [{"input_ids": torch.zeros(n, dtype=torch.long)}
                for n in lognormal_lengths(48, mean=512, cap=8192, seed=seed)]
        docs = [_documents(row_tokens(r), "position_ids" in r) for r in rows]
        assert docs == [_split(r) for r in rows]
        plans = [plan_step(d, world=4, sp=4, token_budget=2048, cost=cost) for d in (docs, [_split(r) for r in rows])]
        assert plans[0] == plans[1]
