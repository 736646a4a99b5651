"""``seqpar plan --length-mean / --lengths-file``: the dynamic SP schedule's predicted gain, printed
as the cost model's prediction (never as a measurement) with the degree histogram it would use."""

from __future__ import annotations

import functools

from seqpar.cli.main import main
from seqpar.planner.gain import lognormal_lengths, predict_gain
from seqpar.planner.work import H100, Shapes, bin_seconds

# Llama-3-8B's shapes on 8 ranks of one node, a 16k maximum: pure Ulysses over the 8 ranks
LLAMA = ["plan", "--heads", "32", "--kv-heads", "8", "--head-dim", "128", "--hidden-size", "4096",
         "--intermediate-size", "14336", "--layers", "32", "--vocab-size", "128256", "--world-size", "8",
         "--devices-per-node", "8", "--seq-len", "16k"]
SHAPES = Shapes(heads=32, kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=14336, layers=32,
                vocab_size=128256)


def _expected(lengths, *, budget=2048, per_step=8 * 2048):
    cost = functools.partial(bin_seconds, shapes=SHAPES, machine=H100, devices_per_node=8, strategy="ulysses")
    return predict_gain(lengths, world=8, sp=8, token_budget=budget, tokens_per_step=per_step, cost=cost)


def _prediction(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("dynamic SP schedule vs static sp=8"))
    return lines[start:]


def test_llama3_8b_on_64_h100s_with_128k_rows_is_a_prediction_with_its_histogram(capsys):
    # the example: Llama-3-8B shapes, 64 ranks of 8 per node, 128k maximum; checkpointing and a
    # 20 GiB activation budget give dp=16 x ulysses=4, the dynamic schedule's degrees 1, 2, 4
    args = LLAMA[:-5] + ["64", "--devices-per-node", "8", "--seq-len", "128k", "--checkpointing",
                         "--memory-budget", "20GiB", "--length-mean", "4k", "--steps", "4", "--seed", "5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "chosen: dp=16 x ulysses=4 x ring=1 (ulysses)" in out
    lines = out.splitlines()
    out = lines[next(i for i, line in enumerate(lines) if line.startswith("dynamic SP schedule vs static sp=4")):]
    assert "a PREDICTION of the cost model" in out[0] and "not a measurement" in out[0]
    budget, per_step = 131072 // 4, 64 * 131072 // 4  # the static job's tokens per rank; one bin per rank
    lengths = lognormal_lengths(round(4 * per_step / 4096), mean=4096, sigma=1.2, cap=131072, seed=5)
    cost = functools.partial(bin_seconds, shapes=SHAPES, machine=H100, devices_per_node=8, strategy="ulysses")
    g = predict_gain(lengths, world=64, sp=4, token_budget=budget, tokens_per_step=per_step, cost=cost)
    assert out[1] == f"  lengths: lognormal, mean 4096, sigma 1.2, max 131072, seed 5: {g.rows} rows, {g.tokens} " \
                     f"tokens, mean {g.tokens / g.rows:.0f}"
    assert out[2] == f"  {g.steps} steps of <= {per_step} tokens; token budget {budget} per rank per bin"
    assert out[3] == "  rows at degree (dynamic): " + ", ".join(
        f"sp={k}: {c} ({c / g.rows:.0%})" for k, c in g.rows_at_degree.items())
    assert out[4] == f"  predicted step time: static {g.static_s / g.steps:.3g} s, dynamic " \
                     f"{g.dynamic_s / g.steps:.3g} s -> predicted {g.ratio:.3f}x of static"
    # many rows are short: the model runs them below sp=4 and predicts a gain
    assert sum(g.rows_at_degree.values()) == g.rows and g.rows_at_degree[1] > g.rows / 3 and g.ratio < 1.0


def test_lengths_file_with_budget_and_step_options(tmp_path, capsys):
    lengths = [16384, 100, 3000, 250, 7, 9000, 512, 512, 40, 1200]
    path = tmp_path / "lengths.txt"
    path.write_text("16384 100, 3000\n250\n7 9000 512,512\n40 1200\n")
    assert main(LLAMA + ["--lengths-file", str(path), "--token-budget", "4k", "--tokens-per-step", "20000"]) == 0
    out = _prediction(capsys.readouterr().out)
    g = _expected(lengths, budget=4096, per_step=20000)
    assert out[1].startswith(f"  lengths: {path}: 10 rows, {sum(lengths)} tokens")
    assert out[2] == f"  {g.steps} steps of <= 20000 tokens; token budget 4096 per rank per bin"
    assert out[4].endswith(f"-> predicted {g.ratio:.3f}x of static")


def test_nothing_to_gain_when_every_row_needs_the_whole_group(tmp_path, capsys):
    (tmp_path / "long.txt").write_text("16384\n" * 6)
    assert main(LLAMA + ["--lengths-file", str(tmp_path / "long.txt")]) == 0
    out = _prediction(capsys.readouterr().out)
    assert out[3] == "  rows at degree (dynamic): sp=8: 6 (100%)"
    assert out[4].endswith("-> predicted 1.000x of static")


def test_bad_distribution_options_name_the_option(tmp_path, capsys):
    (tmp_path / "bad.txt").write_text("12 x 7\n")
    assert main(LLAMA + ["--lengths-file", str(tmp_path / "bad.txt")]) == 2
    assert "--lengths-file" in capsys.readouterr().err
    assert main(LLAMA + ["--lengths-file", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert main(LLAMA + ["--length-mean", "1k", "--lengths-file", str(tmp_path / "bad.txt")]) == 2
    assert "not both" in capsys.readouterr().err
    (tmp_path / "long.txt").write_text("20000\n")  # longer than 8 ranks x the 2048-token default budget
    assert main(LLAMA + ["--lengths-file", str(tmp_path / "long.txt")]) == 2
    err = capsys.readouterr().err
    assert "raise the token budget (--token-budget) to >= 2500" in err and "--seq-len" in err
    assert main(LLAMA + ["--length-mean", "1k", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_a_hybrid_split_is_not_predicted_and_says_why(capsys):
    assert main(LLAMA[:-1] + ["128k", "--world-size", "16", "--length-mean", "4k"]) == 0
    out = capsys.readouterr().out
    assert "x ring=2 (hybrid)" in out
    assert "dynamic SP: not predicted for dp=1 x ulysses=8 x ring=2: a dynamic schedule runs over dp x sp" in out
