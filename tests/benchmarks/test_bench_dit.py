"""benchmarks/bench_dit.py at a tiny shape (issue 47): seqpar's Ulysses (drop-in and sharded) and diffusers'
own Ulysses run the same Flux-shaped model on gloo ranks; every variant is exact against the unsharded
model in float64, and the report prints a row per variant with its ratios to diffusers' and the
text-stream line. Heavy: a minute on this CPU (the timing phase is the bench's; the figures are not
asserted here, the table in docs/guides/diffusers.md is)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.heavy]

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_dit.py"
_ROW = re.compile(r"^(seqpar ulysses \(sharded out\)|seqpar ulysses|diffusers ulysses) +([\d.e+-]+) +([\d.e+-]+) +"
                  r"([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)$")


def test_bench_dit_prints_exact_variants_and_ratios():
    out = subprocess.run([sys.executable, str(_PATH), "--image", "64", "--text", "16", "--heads", "4", "--dim", "8",
                          "--layers", "1", "--repeats", "1", "--check-image", "16", "--check-text", "4"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    rows = {m.group(1): m for m in map(_ROW.match, out.splitlines()) if m}
    assert set(rows) == {"seqpar ulysses", "seqpar ulysses (sharded out)", "diffusers ulysses"}, out
    for name, m in rows.items():
        assert float(m.group(2)) <= 1e-9 and float(m.group(3)) <= 1e-8, (name, out)  # exact, both libraries
    assert float(rows["diffusers ulysses"].group(5)) == 1.0  # the ratios' base
    assert "text stream, one double block per rank" in out and "(seqpar shards it)" in out
