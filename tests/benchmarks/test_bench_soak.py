"""benchmarks/bench_soak.py at a smoke size: the soak runs seqpar train's step on 4 gloo ranks and
prints its table of slopes and verdicts (the figures themselves are the benchmark's, not asserted)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_soak.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_soak", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_soak"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench_soak"]


def test_slope_is_least_squares(bench):
    assert bench.slope([1.0, 2.0, 3.0, 4.0], [3.0, 5.0, 7.0, 9.0]) == pytest.approx(2.0)
    assert bench.slope([1.0, 2.0, 3.0], [4.0, 4.0, 4.0]) == 0.0
    assert bench.slope([5.0], [1.0]) == 0.0


@pytest.mark.distributed
def test_soak_runs_and_prints_its_table():
    # its own process, as make bench runs it: the workers unpickle the bench's function from __main__
    p = subprocess.run([sys.executable, str(_PATH), "--steps", "24", "--warmup", "8", "--every", "4"],
                       capture_output=True, text=True, timeout=400)
    out = p.stdout
    assert p.returncode == 0, out + p.stderr[-4000:]
    assert "seqpar soak: 4 ranks (sp=2, ulysses)" in out and "soak: 24 steps" in out, out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"], out  # one row per rank, every column a number
    assert all(len(r) == 9 and all(float(x) == float(x) for x in r[1:]) for r in rows), out
    for what in ("memory (RSS)", "Python allocations", "step time (CPU)"):
        assert f"verdict {what}: flat" in out or f"verdict {what}: growing" in out, out
