"""benchmarks/bench_soak.py at a smoke size: the soak runs seqpar train's step on 4 gloo ranks and
prints its table of slopes and verdicts, with the plain-model control (the figures themselves are the
benchmark's, not asserted)."""

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


def test_a_drift_the_plain_control_shares_is_the_machines(bench):
    # the step and the control both get 50% slower over the window: growing by the raw bound, flat beyond
    # the control's drift; a step that alone slows is growing by both
    steps, every, warmup = 400, 10, 100
    cpu = [0.070 * (1 + 0.5 * i / steps) for i in range(steps)]
    control = [(k, 0.014 * (1 + 0.5 * k / steps)) for k in range(every, steps + 1, every)]
    result = {"times": cpu, "cpu": cpu, "samples": [(k, 300.0, 250.0, 150.0, 5409, 7.1, 1000)
                                                    for k in range(every, steps + 1, every)],
              "control": control}
    shared = bench.analyse(result, warmup)
    assert not shared["time_flat"] and shared["excess_flat"], shared
    assert abs(shared["excess"]) < 0.05, shared
    alone = bench.analyse({**result, "control": [(k, 0.014) for k, _ in control]}, warmup)
    assert not alone["time_flat"] and not alone["excess_flat"], alone


def test_memory_verdicts_judge_what_a_step_keeps_not_file_pages(bench):
    # 2,000 steps sampled every 10: RSS growing by 0.25 MiB / 100 steps (4.5 MiB over the window) in its
    # file-backed part only (shared libraries' pages read in) is not the process's; the same growth in its
    # anonymous part, the C heap, or one more live tensor per sample is
    steps, every, warmup = 2000, 10, 200
    ks = range(every, steps + 1, every)
    cpu = [0.07] * steps

    def result(anon=0.0, heap=0.0, tensors=0):
        return {"times": cpu, "cpu": cpu, "control": [(k, 0.014) for k in ks],
                "samples": [(k, 370.0 + 0.0025 * k, 297.0 + anon * k, 155.0 + heap * k, 5409 + tensors * k // every,
                             7.1 + 0.01 * tensors * k // every, 1_468_000) for k in ks]}

    files = bench.analyse(result(), warmup)
    assert files["anon_flat"] and files["heap_flat"] and files["tensors_flat"], files
    assert files["rss_slope"] == pytest.approx(0.25) and files["anon_slope"] == pytest.approx(0.0, abs=1e-9)
    assert not bench.analyse(result(anon=0.0025), warmup)["anon_flat"]
    assert not bench.analyse(result(heap=0.0025), warmup)["heap_flat"]
    leak = bench.analyse(result(tensors=1), warmup)
    assert not leak["tensors_flat"] and leak["anon_flat"], leak
    # a small anonymous drift inside the bound (1 MiB over the window) stays flat
    assert bench.analyse(result(anon=1.0 / 1800), warmup)["anon_flat"]


@pytest.mark.heavy  # a whole script or launcher run (make verify): make test stays under 10 minutes
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
    assert all(len(r) == 16 and all(float(x.rstrip("%")) == float(x.rstrip("%")) for x in r[1:]) for r in rows), out
    for what in ("memory (anonymous RSS)", "C heap in use", "live tensors", "Python allocations", "step time (CPU)",
                 "step time (CPU) beyond the plain control's drift"):
        assert f"verdict {what}: flat" in out or f"verdict {what}: growing" in out, out
