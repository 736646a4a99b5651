"""benchmarks/plot_memory_vs_p.py --quick (the README's picture, issue 45): one training step at
P = 1, 2, 4 with and without reduce_memory at tiny sizes; the report has a row per (switches, P) and a
ratio per P, the loss is the same at every P and with the switches (the step is exact, to float32 rounding), each rank
holds less at P = 4 than at P = 1, the switches hold less than the plain step, and the PNG is written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "plot_memory_vs_p.py"
_ROW = re.compile(r"^ *(plain|reduce_memory) P=(\d): peak +([\d.]+) MiB per rank  \(([\d.]+)x P=1\)  "
                  r"loss ([\d.]+)  \((\d+) tokens, (\d+) per rank\)$")
_RATIO = re.compile(r"^reduce_memory / plain at P=(\d): ([\d.]+)x$")


@pytest.mark.heavy
def test_quick_run_reports_every_point_and_draws_the_picture(tmp_path: Path) -> None:
    out = tmp_path / "memory.png"
    p = subprocess.run([sys.executable, str(_PATH), "--quick", "--out", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    lines = p.stdout.strip().splitlines()
    rows = {(m[1], int(m[2])): (float(m[3]), float(m[5])) for m in map(_ROW.match, lines) if m}
    ratios = {int(m[1]): float(m[2]) for m in map(_RATIO.match, lines) if m}
    assert set(rows) == {(s, p) for s in ("plain", "reduce_memory") for p in (1, 2, 4)}, lines
    assert set(ratios) == {1, 2, 4}, lines
    losses = [loss for _, loss in rows.values()]
    assert max(losses) - min(losses) <= 2e-6, losses  # float32, printed to 6 decimals: the same step at every P
    for switches in ("plain", "reduce_memory"):
        assert rows[(switches, 4)][0] < rows[(switches, 2)][0] < rows[(switches, 1)][0]
    for p_ in (1, 2, 4):
        assert rows[("reduce_memory", p_)][0] < rows[("plain", p_)][0]
    assert lines[-1] == f"wrote {out}" and out.stat().st_size > 10_000
