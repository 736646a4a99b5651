"""benchmarks/bench_objectives.py --quick (issue 36): one DPO and one GRPO-style step at sp=1 and sp=4
on gloo ranks at tiny sizes; the printed report has a row per step and sp and a ratio line per step,
the two sp degrees compute the same loss (the step is exact under SP), and sp=4 holds less per rank
than sp=1."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_objectives.py"
_ROW = re.compile(r"^ *(dpo|grpo) sp=(\d): step +([\d.]+) MiB  rss +([\d.]+) MiB  state +([\d.]+) MiB  "
                  r"largest tensor +([\d.]+) MiB \(the shard's \[S, V\] logits: +([\d.]+) MiB\)  "
                  r"loss (-?[\d.]+)  \(per rank, (\d+) tokens\)$")
_RATIO = re.compile(r"^ *(dpo|grpo) sp=4/sp=1: step ([\d.]+)x( \(goal <= 0.35\))?  rss ([\d.]+)x  "
                    r"step\+state ([\d.]+)x$")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_objectives", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_objectives"] = module  # its dataclasses and workers look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench_objectives"]


@pytest.mark.heavy  # a whole script or launcher run (make verify): make test stays under 10 minutes
def test_quick_run_reports_every_step_and_sp_and_sp4_holds_less(bench):
    # a script of its own: the gloo workers find their functions in its __main__
    p = subprocess.run([sys.executable, str(_PATH), "--quick"], capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 6, lines
    rows = {}
    for line in lines:
        if m := _ROW.match(line):
            rows[m[1], int(m[2])] = [float(x) for x in m.groups()[2:]]
        else:
            m = _RATIO.match(line)
            assert m, line
            one, four = rows[m[1], 1], rows[m[1], 4]
            assert float(m[2]) == pytest.approx(four[0] / one[0], abs=2e-3)  # the ratio of the rows above (rounded)
            assert float(m[2]) < 1.0  # sp=4 holds less per rank than sp=1
            assert (m[3] is not None) == (m[1] == "dpo")  # the goal is printed with the DPO ratio
    assert sorted(rows) == [("dpo", 1), ("dpo", 4), ("grpo", 1), ("grpo", 4)]
    q = bench.QUICK
    for step in ("dpo", "grpo"):
        one, four = rows[step, 1], rows[step, 4]
        assert one[6] == four[6] == (2 * q.seq if step == "dpo" else q.group * (q.seq // 2))  # tokens
        assert one[2] == four[2] > 0  # the model state does not depend on sp
        assert one[4] == pytest.approx(4 * four[4])  # the shard's [S, V]: a quarter at sp=4
        assert 0 < one[3] < one[4]  # nothing as large as the logits of the shard is ever made
        # float32, SGD after one warm-up step: the same loss to the rounding of ~250-token sums
        assert four[5] == pytest.approx(one[5], rel=1e-4, abs=1e-5)
