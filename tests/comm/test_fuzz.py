"""Seeded fuzz of sp_attention and shard_batch + parallelize (issue 26, item 7;
:mod:`seqpar.testing.fuzz`): every drawn case -- odd lengths, S < P, GQA, float32, padding left /
right / whole rows, packed documents (position ids, cu_seq_lens), labels all -100 or of the wrong
shape, and one rank given another dtype, shape, mask, option or batch -- ends exact against the
unsharded float64 reference or in a ValueError on every rank; no hang (a 10 s process-group timeout
turns one into a failure), no other exception. A failure names its seed:
``python benchmarks/bench_fuzz.py --seed S --cases 1 --nproc P`` replays it.
"""

import pytest

from seqpar.testing.fuzz import problems, run_fuzz, verdict
from seqpar.testing.fuzz_cases import FuzzCase, Outcome, draw

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes

PG_TIMEOUT_S = 10.0
WORLD = 4  # make test: one spawn, at the size that also draws the hybrid strategy
REGRESSIONS = {  # seeds at WORLD whose cases found a bug (fixed), run first
    35: "rank 1 ran ring, the others ulysses: the ranks hung in different collectives (now: a ValueError); "
        "found at P=2 by an earlier draw",
    80: "rank 3 parallelized the model with ring, the others with ulysses: a hang or a gloo abort (now: a "
        "ValueError at the model's first forward)",
    265: "rank 1 ran ring on the hybrid mesh, the others hybrid: hybrid validated over its ulysses sub-group, "
         "ring over the whole sp group -- a timeout on every rank (now: hybrid agrees over the mesh's sp group, "
         "a ValueError)",
}


def _run(world: int, seeds: list[int]) -> tuple[dict[str, int], list[str]]:
    counts, bad = problems(world, seeds, run_fuzz(world, seeds, pg_timeout=PG_TIMEOUT_S))
    print(f"fuzz P={world}, seeds {seeds[0]}..{seeds[-1]}: {dict(sorted(counts.items()))}")
    return counts, bad


def test_draw_is_a_function_of_the_seed():
    assert draw(7, 3) == draw(7, 3)
    assert len({draw(s, 4) for s in range(50)}) == 50
    kinds = {draw(s, 4).target for s in range(50)} | {bool(draw(s, 4).odd) for s in range(50)}
    assert kinds == {"attention", "model", True, False}


def test_verdict_holds_every_case_to_exact_or_valueerror_everywhere():
    clean = draw(0, 2)
    odd = FuzzCase(**{**clean.__dict__, "odd": "dtype", "odd_rank": 1})
    assert verdict(clean, [Outcome("exact")] * 2) == ("exact", None)
    assert verdict(odd, [Outcome("ValueError", "x")] * 2) == ("ValueError[odd dtype]", None)
    assert verdict(odd, [Outcome("exact")] * 2)[1] is not None  # a disagreement must not run through
    assert verdict(clean, [Outcome("ValueError", "x"), Outcome("timeout", "y")])[1] is not None
    assert verdict(clean, [Outcome("RuntimeError", "x")] * 2)[1] is not None
    assert verdict(clean, [Outcome("inexact", "x")] * 2)[1] is not None


def test_fuzz_small():
    assert draw(35, WORLD).odd == "strategy"  # the regressions are still what their seeds draw
    assert (draw(80, WORLD).target, draw(80, WORLD).odd, draw(80, WORLD).strategy) == ("model", "strategy", "ulysses")
    assert (draw(265, WORLD).strategy, draw(265, WORLD).odd) == ("hybrid", "strategy")
    counts, bad = _run(WORLD, [*REGRESSIONS, *range(1000, 1012)])
    assert not bad, "\n".join(bad)
    assert counts.get("exact", 0) > 0 and any(k.startswith("ValueError[odd") for k in counts), counts


@pytest.mark.heavy
@pytest.mark.parametrize("world", [2, 3, 4])
def test_fuzz_large(world):
    counts, bad = _run(world, list(range(100_000, 100_100)))
    assert not bad, "\n".join(bad)
