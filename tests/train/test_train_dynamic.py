"""``seqpar train --sp-schedule dynamic``: on a JSONL of mixed lengths it trains to the static
schedule's loss curve (float64, the same rows per step), its summary, summary.json and metrics say
how many rows ran at each degree, ``--token-budget`` forms steps (and grad-accum micro-steps) by
tokens, the memory switches (tiled loss and MLP, layer checkpoints) run in its bins below --sp
to the same curve, and options that do not combine are refused by name before any worker starts."""

from __future__ import annotations

import json
import math
import random

import pytest

from seqpar.cli.train import format_summary
from seqpar.train import TrainConfig
from seqpar.train.checks import check_config
from seqpar.train.job import prepare_job
from seqpar.train.launcher import run_local

OFF = dict(tiled_loss=False, tiled_mlp=False, checkpoint="none")
LOSS_TOL = 1e-9  # float64: the schedules agree far below float32 rounding


def _jsonl(path) -> str:
    rng = random.Random(3)
    with open(path, "w") as f:
        for _ in range(60):  # mostly short rows, a few of the whole --seq-len
            n = rng.choice([rng.randint(4, 20)] * 4 + [rng.randint(40, 64)])
            f.write(json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(n))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dyn")
    base = TrainConfig(data=[_jsonl(root / "mixed.jsonl")], seq_len=64, sp=2, micro_batch=4, steps=3, lr=1e-2, warmup=1,
                       dtype="float64", eval_rows=0, progress=False, plot=False, seed=1, **OFF)
    out = {}
    for name, cfg in [("static", base), ("dynamic", base.replace(sp_schedule="dynamic")),
                      # the memory switches in bins below --sp: tiles far below the shards
                      ("memory", base.replace(sp_schedule="dynamic", tiled_loss=True, tiled_mlp=True,
                                              checkpoint="layers", loss_tile=4, mlp_tile=3)),
                      ("budget", base.replace(sp_schedule="dynamic", micro_batch=1, token_budget=40, grad_accum=2))]:
        out[name] = run_local(prepare_job(cfg.replace(save_dir=str(root / name))))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["dynamic", "memory"])
def test_dynamic_trains_to_the_static_loss_curve(runs, name):
    static, dynamic = runs["static"].losses, runs[name].losses
    assert [s for s, _ in static] == [s for s, _ in dynamic] == [1, 2, 3]
    for (step, a), (_, b) in zip(static, dynamic, strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(a), f"step {step}: static {a!r} vs {name} {b!r}"
    assert set(runs[name].sp_degrees) == {1, 2}, runs[name].sp_degrees


@pytest.mark.distributed
def test_the_summary_shows_the_degree_histogram(runs):
    s = runs["dynamic"]
    assert set(s.sp_degrees) == {1, 2}, s.sp_degrees  # short rows at sp=1, rows of --seq-len at sp=2
    assert sum(s.sp_degrees.values()) == 3 * 4  # steps x rows per step
    assert f"rows at sp=1/2: {s.sp_degrees[1]}/{s.sp_degrees[2]}" in format_summary(s)
    with open(s.summary_file) as f:
        assert {int(k): v for k, v in json.load(f)["sp_degrees"].items()} == s.sp_degrees
    with open(s.metrics) as f:
        lines = [m for m in map(json.loads, f) if "rows_at_degree" in m]
    assert len(lines) == 3 and sum(sum(m["rows_at_degree"].values()) for m in lines) == 12
    assert runs["static"].sp_degrees == {} and "schedule" not in format_summary(runs["static"])


@pytest.mark.distributed
def test_token_budget_steps(runs):
    s = runs["budget"]
    # 2 micro-steps of at most 2 ranks x 40 tokens each per step: more rows than --micro-batch would give
    rows = sum(s.sp_degrees.values())
    assert rows > 3 * 2 * 2, s.sp_degrees
    assert all(math.isfinite(loss) and loss > 0 for _, loss in s.losses)
    with open(s.metrics) as f:
        tokens = [m["tokens"] for m in map(json.loads, f) if "rows_at_degree" in m]
    assert len(tokens) == 3 and all(0 < t <= 2 * 2 * 40 for t in tokens), tokens


@pytest.mark.parametrize("changes, needle", [
    (dict(token_budget=64), "--token-budget forms the steps of a dynamic schedule: give --sp-schedule dynamic"),
    (dict(sp_schedule="dynamic", strategy="hybrid", sp=4), "use --strategy ulysses or ring"),
    (dict(sp_schedule="dynamic", fsdp="on"), "use --fsdp off"),
    (dict(sp_schedule="dynamic", token_budget=64, micro_batch=2), "leave --micro-batch at 1"),
    (dict(sp_schedule="dynamic", token_budget=31, seq_len=64), "use --token-budget >= 32"),
    (dict(sp_schedule="weekly"), "unknown --sp-schedule 'weekly'"),
])
def test_options_that_do_not_combine(changes, needle):
    with pytest.raises(ValueError) as e:
        check_config(TrainConfig(**changes))
    assert needle in str(e.value)


def test_the_options_reach_the_command_line():
    from seqpar.cli.main import build_parser

    args = build_parser().parse_args(["train", "--sp-schedule", "dynamic", "--token-budget", "512"])
    assert (args.sp_schedule, args.token_budget) == ("dynamic", 512)
