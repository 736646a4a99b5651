"""Ulysses attention against the float64 reference, forward and backward, over real gloo processes
(sinks, chunked attention and MLA head dims included); outputs are contiguous. At P = 1 and 3 make
test runs a covering quarter of the grid (the rest: heavy)."""

import pytest

from seqpar.comm.launch import run_distributed
from seqpar.testing.attention_parity import AttnCase, attention_grid, bad_rows, run_cases, run_rest
from seqpar.testing.sampling import covering_sample, split_problems

TOL = 1e-10
CASES = attention_grid("ulysses", quick=False) + [
    # scale and softcap with the reference kernel, window with every kernel that supports it
    AttnCase(seq=37, heads=6, kv_heads=1, causal=False, window=6, softcap=2.0, mask="packed"),
    AttnCase(seq=37, heads=8, kv_heads=2, causal=True, kernel="flash_cpu", window=7, mask="none"),
    AttnCase(seq=129, heads=28, kv_heads=4, causal=True, kernel="flash_cpu", mask="pad"),
    AttnCase(seq=7, heads=3, kv_heads=1, causal=True, mask="pad"),  # fewer query heads than P=4
]


# make test runs the whole grid at P = 2 and 4; at P = 1 (no exchange) and 3 a quarter of it that
# still meets every option value, and make verify the rest (test_rest_of_the_grid_within_tolerance)
SAMPLED = (1, 3)
SAMPLE, REST = covering_sample(CASES, 4)


def _grid(p):
    return SAMPLE if p in SAMPLED else CASES


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda p: f"P{p}")
def grid(request):
    return request.param, run_distributed(run_cases, request.param, _grid(request.param), timeout=600)[0]


@pytest.mark.distributed
def test_grid_within_tolerance(grid):
    p, rows = grid
    assert [r["label"] for r in rows] == [c.label() for c in _grid(p)]
    bad = bad_rows(rows, TOL)
    assert not bad, f"P={p}: {len(bad)} case(s) past {TOL}: {bad[:5]}"


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("p", SAMPLED, ids=lambda p: f"P{p}")
def test_rest_of_the_grid_within_tolerance(p):
    run_rest(REST, p, TOL)


def test_sample_meets_every_option_value_and_the_rest_completes_it():
    assert len(SAMPLE) < len(CASES) // 3
    assert not split_problems(SAMPLE, REST, CASES)


def test_grid_covers_the_required_cases():
    labels = {c.label() for c in CASES}
    for s in (1, 7, 37, 129):
        for h, hk in ((8, 8), (8, 2), (8, 1), (6, 3), (6, 1), (12, 4)):
            for causal in (0, 1):
                for mask in ("none", "pad", "packed"):
                    assert f"ulysses/reference S={s} H={h}/{hk} causal={causal} mask={mask}" in labels
    for kernel in ("reference", "auto", "sdpa_dense"):
        of_kernel = [c for c in CASES if c.kernel == kernel]
        assert any(c.chunk and c.window for c in of_kernel) and any(c.chunk and c.mask == "pad" for c in of_kernel)
        assert {5, 12} <= {c.v_head_dim for c in of_kernel}
        assert any(c.sinks for c in of_kernel) == (kernel != "sdpa_dense")
    assert any(c.sinks and c.heads < 4 for c in CASES)  # idle ranks give sinks a zero gradient
