"""benchmarks/bench_ep.py --quick (issue 46): ep = 1, 2, 4 at sp = 4 on gloo ranks at tiny sizes; the
report has a row per layout and a ratio line per ep > 1, every layout computes the same loss, and a
rank holds 1/ep of the expert parameters."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ep.py"
_ROW = re.compile(r"^ *ep=(\d): expert params +([\d.]+) MiB/rank  all-to-all buffers +([\d.]+) MiB/step  "
                  r"step +([\d.]+) ms  loss ([\d.]+)$")
_RATIO = re.compile(r"^ *ep=(\d)/ep=1: expert params ([\d.]+)x  step ([\d.]+)x$")


@pytest.mark.heavy
@pytest.mark.distributed
def test_quick_report():
    out = subprocess.run([sys.executable, str(_PATH), "--quick"], capture_output=True, text=True, timeout=900,
                         check=True).stdout.splitlines()
    rows = {int(m[1]): m for m in map(_ROW.match, out) if m}
    ratios = {int(m[1]): float(m[2]) for m in map(_RATIO.match, out) if m}
    assert sorted(rows) == [1, 2, 4], out
    assert len({m[5] for m in rows.values()}) == 1, out  # the same loss in every layout
    assert float(rows[1][3]) == 0.0 and float(rows[2][3]) > 0, out  # no expert exchange without EP
    assert ratios == {2: 0.5, 4: 0.25}, out
