"""seqpar bench: the case grid, ratios, CSV and plot (pure), bad options, and one real measurement
(1 rank vs 2 ranks at 1024 tokens, fresh processes each) whose memory per rank must drop."""

import csv
import math

import pytest

from seqpar import bench
from seqpar.cli.main import main


def _row(p, strategy, n, mem, t):
    return {"model": "tiny-llama", "model_config": "", "nproc": p, "strategy": strategy, "seq_len": n, "steps": 1,
            "dtype": "float32", "seed": 0, "mem_mib": mem, "mem_mib_per_rank": [mem] * p, "step_s": t,
            "measure": "peak RSS"}


def test_cases_one_baseline_per_length_and_hybrid_only_from_4():
    cases = bench.cases("tiny-llama", "", [1024, 2048], [2, 4], ["ulysses", "ring", "hybrid"], 2, "float32")
    singles = [c for c in cases if c.nproc == 1]
    assert [c.seq_len for c in singles] == [1024, 2048]
    assert {(c.nproc, c.strategy) for c in cases if c.nproc > 1} == {
        (2, "ulysses"), (2, "ring"), (4, "ulysses"), (4, "ring"), (4, "hybrid")}
    assert len(cases) == 2 + 2 * 5


def test_ratios_are_against_one_rank_at_the_same_length(tmp_path):
    rows = bench.add_ratios([_row(1, "ulysses", 1024, 40.0, 0.2), _row(2, "ring", 1024, 20.0, 0.3),
                             _row(2, "ulysses", 2048, 30.0, 0.4)])
    assert rows[1]["mem_ratio"] == 0.5 and rows[1]["time_ratio"] == pytest.approx(1.5)
    assert math.isnan(rows[2]["mem_ratio"])  # no 1-rank row at 2048
    path = tmp_path / "b.csv"
    bench.write_csv(rows, str(path))
    got = list(csv.DictReader(open(path)))
    assert got[1]["mem_ratio"] == "0.500" and got[1]["tokens_per_rank"] == "512"
    bench.plot(rows, str(tmp_path / "b.png"), "t")
    assert (tmp_path / "b.png").stat().st_size > 1000
    assert "0.500" in bench.format_table(rows)


@pytest.mark.distributed
@pytest.mark.parametrize("args, needle", [
    (["--strategies", "zigzag"], "--strategies"),
    (["--seq-lens", "4", "--nproc", "4"], "--seq-lens 4"),
    (["--model", "/no/such"], "--model"),
    (["--steps", "0"], "--steps"),
])
def test_bad_options(capsys, args, needle):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("seqpar bench: error:") and needle in err and "Traceback" not in err


@pytest.mark.distributed
def test_real_measurement_memory_per_rank_drops(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "--seq-lens", "1024", "--nproc", "2", "--strategies", "ulysses", "--steps", "1",
                 "--out", str(out)])
    assert code == 0
    rows = list(csv.DictReader(open(out / "bench.csv")))
    assert [(r["nproc"], r["seq_len"]) for r in rows] == [("1", "1024"), ("2", "1024")]
    one, two = (float(r["mem_mib"]) for r in rows)
    assert one > 5 and 0 < two < 0.8 * one, rows  # activations split over the ranks
    assert float(rows[1]["mem_ratio"]) == pytest.approx(two / one, abs=2e-3)
    assert (out / "bench.png").stat().st_size > 1000
    assert "vs 1 rank" in capsys.readouterr().out
