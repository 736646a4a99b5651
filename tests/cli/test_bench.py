"""seqpar bench: the case grids, ratios, CSV and plot (pure), bad options, one real measurement
(1 rank vs 2 ranks at 1024 tokens, fresh processes each) whose memory per rank must drop, and one
real ``--packing`` run (plain vs packed rows, hybrid skipped at P=2 with its reason)."""

import csv
import math

import pytest

from seqpar import bench
from seqpar.bench import search
from seqpar.cli import bench as cli_bench
from seqpar.cli.main import main
from seqpar.cli.tables import write_csv


def _row(p, strategy, n, mem, t, doc_len=0):
    return {"model": "tiny-llama", "model_config": "", "nproc": p, "strategy": strategy, "seq_len": n, "steps": 1,
            "dtype": "float32", "seed": 0, "doc_len": doc_len, "mem_mib": mem, "mem_mib_per_rank": [mem] * p,
            "rss_mib": 2 * mem, "step_s": t, "measure": "live tensors"}


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
    write_csv(rows, str(path), cli_bench.CSV_FIELDS)
    got = list(csv.DictReader(open(path)))
    assert got[1]["mem_ratio"] == "0.500" and got[1]["tokens_per_rank"] == "512" and got[1]["rss_mib"] == "40.0"
    cli_bench.plot(rows, str(tmp_path / "b.png"), "t")
    assert (tmp_path / "b.png").stat().st_size > 1000
    assert "0.500" in cli_bench.format_table(rows)


def test_packing_cases_plain_and_packed_per_length_hybrid_skipped_below_4():
    cases, skipped = bench.packing_cases("tiny-llama", "", [1024, 2048], [1, 2, 4], ["ring", "hybrid"], 1,
                                         "float32", 256)
    assert {(c.nproc, c.strategy, c.seq_len, c.doc_len) for c in cases} == {
        (p, s, n, d) for p, s in ((2, "ring"), (4, "ring"), (4, "hybrid")) for n in (1024, 2048) for d in (0, 256)}
    assert len(cases) == 12 and len(skipped) == 2
    assert skipped[0].startswith("P=1") and skipped[1].startswith("hybrid at P=2") and "--nproc 4" in skipped[1]
    assert bench.bench_batch(1024, 256)["position_ids"][0, 250:260].tolist() == [250, 251, 252, 253, 254, 255,
                                                                                 0, 1, 2, 3]
    assert "position_ids" not in bench.bench_batch(1024)


def test_packing_ratios_growth_table_and_csv(tmp_path):
    rows = bench.add_packing_ratios([
        _row(2, "ring", 1024, 10.0, 1.0), _row(2, "ring", 1024, 12.0, 0.5, 128),
        _row(2, "ring", 2048, 20.0, 4.0), _row(2, "ring", 2048, 48.0, 1.0, 128),
        _row(2, "ulysses", 2048, 16.0, 3.0)])
    ring_plain, ring_packed = rows[2], rows[3]
    assert ring_plain["mem_ratio"] == 1.0 and ring_plain["growth"] == 2.0
    assert ring_packed["mem_ratio"] == 2.4 and ring_packed["time_ratio"] == 0.25 and ring_packed["growth"] == 4.0
    assert math.isnan(rows[0]["growth"]) and math.isnan(rows[4]["growth"])  # no row at half the length
    table = cli_bench.format_packing_table(rows)
    ring_2048 = next(line for line in table.splitlines() if line.startswith(" 2 ring") and " 2048 " in line)
    assert ring_2048.split() == ["2", "ring", "2048", "|", "20.0", "48.0", "2.40", "|", "4.000", "1.000", "0.25", "|",
                                 "2.00", "4.00"]
    ulysses_line = table.splitlines()[-1].split()
    assert ulysses_line[4:7] == ["16.0", "-", "-"]  # no packed row: no ratio
    path = tmp_path / "p.csv"
    write_csv(rows, str(path), cli_bench.PACKING_CSV_FIELDS)
    got = list(csv.DictReader(open(path)))
    assert (got[3]["doc_len"], got[3]["mem_ratio"], got[3]["growth"]) == ("128", "2.400", "4.000")


@pytest.mark.distributed
@pytest.mark.parametrize("args, needle", [
    (["--strategies", "zigzag"], "--strategies"),
    (["--seq-lens", "4", "--nproc", "4"], "--seq-lens 4"),
    (["--model", "/no/such"], "--model"),
    (["--steps", "0"], "--steps"),
    (["--packing", "2048", "--seq-lens", "2048"], "--packing 2048"),
    (["--packing", "--nproc", "1"], "P=1"),
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


@pytest.mark.distributed
def test_real_packing_run_plain_vs_packed(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "--packing", "128", "--seq-lens", "1024", "--nproc", "2", "--strategies", "ring,hybrid",
                 "--model-config", '{"num_hidden_layers": 1}', "--out", str(out)])
    assert code == 0
    rows = list(csv.DictReader(open(out / "bench_packing.csv")))
    assert [(r["strategy"], r["seq_len"], r["doc_len"]) for r in rows] == [("ring", "1024", "0"),
                                                                            ("ring", "1024", "128")]
    plain, packed = (float(r["mem_mib"]) for r in rows)
    assert 0 < packed <= 1.5 * plain, rows  # 128-token documents: no mask of the row's size
    assert float(rows[1]["mem_ratio"]) == pytest.approx(packed / plain, abs=0.01)  # the CSV rounds MiB to 0.1
    assert (out / "bench_packing.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "packed MiB" in printed and "skipped hybrid at P=2" in printed


# ---------------------------------------------------------------- --max-seq

def test_max_seq_search_grows_then_bisects(monkeypatch):
    """The search logic on a fake step that fits up to 5000 tokens: it brackets from the start by
    doubling or halving, bisects to the precision, and returns the longest fitting multiple."""
    tried = []

    def fake(case, cap, timeout=0.0):
        tried.append(case.seq_len)
        fits = case.seq_len <= 5000
        return bench.Trial(case.seq_len, fits, 1.0 if fits else float("nan"), 0.1, not fits)

    monkeypatch.setattr(search, "try_step", fake)
    case = bench.BenchCase("tiny-llama", "", 1, "ulysses", 64, sizing="builtin")
    best, trials = bench.max_seq(case, 1, start=1000, granularity=64, precision=0.05)
    assert tried[:4] == [960, 1920, 3840, 7680] and [t.seq_len for t in trials] == tried
    assert best <= 5000 < best + max(64, 0.05 * best) and best % 64 == 0
    tried.clear()
    best2, _ = bench.max_seq(case, 1, start=40000, granularity=64, precision=0.05)  # from above: halve first
    assert tried[:4] == [40000, 19968, 9984, 4992] and best2 == best
    tried.clear()
    assert bench.max_seq(case, 1, start=64, granularity=64, limit=256)[0] == 256  # never past the limit
    tried.clear()
    assert bench.max_seq(case, 1, start=1000, granularity=64, limit=3000)[0] == 2944  # the limit tried last
    assert tried == [960, 1920, 2944]
    monkeypatch.setattr(search, "try_step", lambda c, cap, timeout=0.0: bench.Trial(c.seq_len, False, 0, 0, True))
    assert bench.max_seq(case, 1, start=1000, granularity=64)[0] == 0  # nothing fits


def test_max_seq_switch_sets_and_ratios():
    from seqpar.cli import max_seq

    off, on, lo = max_seq.parse_switches("off,on,loss+offload", loss_tile=128)
    assert (off.label, on.label, lo.label) == ("off", "loss+mlp+layers", "loss+offload")
    assert on.loss_tile == 128 and on.mlp_tile is None and off.loss_tile is None
    for bad in ("loss+ckpt", "layers+offload", ","):
        with pytest.raises(ValueError, match="--switches"):
            max_seq.parse_switches(bad)
    rows = bench.add_max_seq_ratios([
        {"nproc": 1, "strategy": "ulysses", "switches": "off", "max_seq": 1000},
        {"nproc": 1, "strategy": "ulysses", "switches": "on", "max_seq": 8000},
        {"nproc": 4, "strategy": "ulysses", "switches": "on", "max_seq": 36000},
        {"nproc": 4, "strategy": "ring", "switches": "on", "max_seq": 30000}])
    assert (rows[1]["vs_off"], rows[2]["vs_p1"], rows[3]["vs_p1"]) == (8.0, 4.5, 3.75)
    assert math.isnan(rows[2]["vs_off"])  # no P=4 row without switches


@pytest.mark.distributed
@pytest.mark.parametrize("args, needle", [
    (["--max-seq", "--packing"], "--max-seq and --packing"),
    (["--max-seq", "--switches", "tiles"], "--switches"),
    (["--max-seq", "--mem-cap", "10"], "--mem-cap"),
    (["--max-seq", "--model-config", '{"vocab_size": 8}'], "vocab_size 8"),
])
def test_max_seq_bad_options(capsys, args, needle):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("seqpar bench: error:") and needle in err and "Traceback" not in err


@pytest.mark.distributed
def test_max_seq_real_search_under_a_tiny_cap(tmp_path, capsys):
    out = tmp_path / "out"
    cap_mib = 20
    code = main(["bench", "--max-seq", "--model", "tiny-llama", "--model-config", '{"vocab_size": 2048}',
                 "--mem-cap", f"{cap_mib}MiB", "--nproc", "1", "--switches", "off", "--precision", "0.5",
                 "--out", str(out)])
    assert code == 0
    (row,) = list(csv.DictReader(open(out / "bench_max_seq.csv")))
    best = int(row["max_seq"])
    assert best > 0 and best % 64 == 0 and 0 < float(row["peak_mib"]) <= cap_mib
    trials = list(csv.DictReader(open(out / "bench_max_seq_trials.csv")))
    fitting = [int(t["seq_len"]) for t in trials if t["fits"] == "True"]
    over = [int(t["seq_len"]) for t in trials if t["fits"] == "False"]
    assert max(fitting) == best and over and min(over) > best  # found by running: one length above did not fit
    assert min(over) - best <= max(64, 0.5 * best)
    assert all(float(t["peak_mib"]) > cap_mib for t in trials if t["fits"] == "False" and t["stopped"] == "False")
    assert (out / "bench_max_seq.png").stat().st_size > 1000
    assert "max_seq" in capsys.readouterr().out
