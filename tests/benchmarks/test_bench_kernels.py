"""benchmarks/bench_kernels.py --choice at a tiny size on the CPU (issue 27): it times every
candidate for each block kind and direction, as ``auto`` measures them, and names the fastest."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


def test_choice_times_each_candidate_per_block_and_direction(monkeypatch):
    monkeypatch.delenv("SEQPAR_MEASURE_KERNELS", raising=False)
    spec = importlib.util.spec_from_file_location("bench_kernels", _PATH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_kernels"] = bench
    try:
        spec.loader.exec_module(bench)
        rows = bench.choice_rows(torch.device("cpu"), torch.float32, [32, 64], 4, 2, 8, 16, ["flash_cpu", "tiled"])
    finally:
        del sys.modules["bench_kernels"]
    got = sorted((seq, key.block, key.direction) for seq, key, _, _ in rows)
    assert got == sorted((seq, block, d) for seq in (32, 64) for block in ("fused causal", "fused full", "masked")
                         for d in ("forward", "backward"))
    for _, key, seconds, best in rows:
        assert set(seconds) == {"flash_cpu", "tiled"} and all(t > 0 for t in seconds.values())
        assert best == min(seconds, key=seconds.__getitem__)
        assert (key.gqa, key.head_dim) == (2, 8)


def test_choice_refuses_when_measurement_is_off(monkeypatch):
    monkeypatch.setenv("SEQPAR_MEASURE_KERNELS", "0")
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", "--choice", "--device", "cpu", "--seq", "32"])
    spec = importlib.util.spec_from_file_location("bench_kernels", _PATH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit, match="SEQPAR_MEASURE_KERNELS=0"):
        bench.main()
