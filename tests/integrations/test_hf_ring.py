"""Whole-model parity with strategies ring (contiguous, zigzag and doc-zigzag) and hybrid (2 x 2) on 4
processes: loss within 1e-9 and every parameter gradient within 1e-8 of the non-SP model, float64."""

from dataclasses import replace

import pytest
import torch

import seqpar.attention.dispatch as attention
from seqpar.comm.launch import run_distributed
from seqpar.comm.mesh import init_mesh
from seqpar.testing.model_parity import F32_RTOL, GRAD_TOL, LOSS_TOL, compare, model_cases

P = 4
FULL_SETUPS = (("ring", "contiguous"), ("ring", "zigzag"), ("hybrid", "zigzag"), ("hybrid", "contiguous"))
SETUPS = (*FULL_SETUPS, ("ring", "doc-zigzag"), ("hybrid", "doc-zigzag"))


def _cases():
    cases = []
    for strategy, layout in FULL_SETUPS:
        # padded, packed and plain rows at odd and even lengths; 6 query / 2 KV heads (H % P != 0)
        cases += [replace(c, layout=layout) for c in model_cases("tiny-llama", strategy)]
        # sliding window shorter than the sequence (Mistral), q/k norm (Qwen3), softcap (Gemma 2)
        cases += [replace(c, layout=layout) for c in model_cases("tiny-mistral", strategy)[:2]]
        cases += [replace(c, layout=layout) for m in ("tiny-qwen3", "tiny-gemma2")
                  for c in model_cases(m, strategy)[1:2]]
    # activation checkpointing: the ring (and its guard) recomputed in the backward
    cases += [replace(model_cases("tiny-llama", s)[1], layout="zigzag", checkpointing="non-reentrant")
              for s in ("ring", "hybrid")]
    # doc-zigzag (the permutation follows each batch's documents and padding): padded and packed rows,
    # and packed rows under a sliding window
    cases += [replace(c, layout="doc-zigzag") for s in ("ring", "hybrid") for c in model_cases("tiny-llama", s)[:2]]
    cases += [replace(model_cases("tiny-mistral", "ring")[1], layout="doc-zigzag")]
    return cases


CASES = _cases()


def _worker(rank, world, cases):
    torch.set_num_threads(1)
    meshes = {"ring": init_mesh(sp=world, device_type="cpu"),
              "hybrid": init_mesh(sp=world, ulysses=2, ring=world // 2, device_type="cpu")}
    calls = dict.fromkeys(attention.STRATEGIES, 0)
    saved = dict(attention.STRATEGIES)

    def counted(name):
        def fn(*args, **kwargs):
            calls[name] += 1
            return saved[name](*args, **kwargs)
        return fn

    rows = []
    try:  # count which strategy the model's attention layers really ran
        attention.STRATEGIES.update({name: counted(name) for name in saved})
        for case in cases:
            before = dict(calls)
            row = compare(case, meshes[case.strategy], world)
            row["strategy_calls"] = {n: calls[n] - before[n] for n in calls if calls[n] != before[n]}
            rows.append(row)
    finally:
        attention.STRATEGIES.update(saved)
    return rows


@pytest.fixture(scope="module")
def rows():
    return run_distributed(_worker, P, CASES, timeout=600)[0]


@pytest.mark.distributed
@pytest.mark.parametrize("i", range(len(CASES)), ids=[c.label() for c in CASES])
def test_model_parity(rows, i):
    row, case = rows[i], CASES[i]
    assert row["label"] == case.label()
    assert row["loss_diff"] <= LOSS_TOL, row
    assert row["grad_max"] <= GRAD_TOL, (row["worst_param"], row["grad_max"], row["grad_diff"])
    assert row["f32_rel"] <= F32_RTOL, row  # Gemma's float32 norm weights, relative
    # every attention layer went through the strategy under test, and only it
    assert set(row["strategy_calls"]) == {case.strategy} and row["strategy_calls"][case.strategy] > 0, row


def test_cases_cover_ring_and_hybrid_layouts():
    assert {(c.strategy, c.layout) for c in CASES} == set(SETUPS)
    assert {c.model for c in CASES} == {"tiny-llama", "tiny-mistral", "tiny-qwen3", "tiny-gemma2"}
