"""benchmarks/bench_ring_step.py at a tiny size on the CPU (issue 27): it times the three variants
and the ring it times runs every block fused (the rectangles variant is the padded-mask path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ring_step.py"


def test_ring_step_times_sdpa_fused_and_rectangles_of_one_rank():
    spec = importlib.util.spec_from_file_location("bench_ring_step", _PATH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_ring_step"] = bench
    try:
        spec.loader.exec_module(bench)
        m = bench.measure(64, 4, 1, 4, 2, 8, torch.float32, torch.device("cpu"), 1)
    finally:
        del sys.modules["bench_ring_step"]
    assert m["ops"] == {"fused causal": 1, "fused full": 3}
    assert all(m[name] > 0 for name in ("sdpa", "fused", "rects"))
    assert not torch.distributed.is_initialized()
