"""``seqpar train --sp-schedule dynamic``: on a JSONL of mixed lengths it trains to the static
schedule's loss curve (float64, the same rows per step), its summary, summary.json and metrics say
how many rows ran at each degree, ``--token-budget`` forms steps (and grad-accum micro-steps) by
tokens, the memory switches (tiled loss and MLP, layer checkpoints) run in its bins below --sp
to the same curve, and options that do not combine are refused by name before any worker starts. Under
``--fsdp on`` (heavy: 4 ranks) it trains to the static schedule's losses and final weights, float64,
at sp=4 with grad-accum micro-steps and at dp=2 x sp=2, and runs bfloat16's mixed precision."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from seqpar.cli.train import format_summary
from seqpar.train import TrainConfig
from seqpar.train.checks import check_config
from seqpar.train.job import prepare_job
from seqpar.train.launcher import run_local
from seqpar.train.model_setup import fsdp_options

OFF = dict(tiled_loss=False, tiled_mlp=False, checkpoint="none")
LOSS_TOL = 1e-9  # float64: the schedules agree far below float32 rounding
# the builtin cost model: the same schedules every run, so the degrees these tests expect do not hang on
# timings (--cost-model measure, the default, is tested by itself: test_a_measured_cost_model)
DYN = dict(sp_schedule="dynamic", cost_model="builtin")


def _schedule(schedule: str) -> dict:
    return DYN if schedule == "dynamic" else dict(sp_schedule=schedule)


def _jsonl(path, mid: bool = False) -> str:
    rng = random.Random(3)
    with open(path, "w") as f:
        for _ in range(60):  # mostly short rows, a few of the whole --seq-len (mid: some of half of it too)
            n = rng.choice([rng.randint(4, 14 if mid else 20)] * 4 + [rng.randint(40, 64)]
                           + [rng.randint(20, 30)] * (2 if mid else 0))
            f.write(json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(n))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dyn")
    base = TrainConfig(data=[_jsonl(root / "mixed.jsonl")], seq_len=64, sp=2, micro_batch=4, steps=3, lr=1e-2, warmup=1,
                       dtype="float64", eval_rows=0, progress=False, plot=False, seed=1, **OFF)
    out = {}
    for name, cfg in [("static", base), ("dynamic", base.replace(**DYN)),
                      # the memory switches in bins below --sp: tiles far below the shards
                      ("memory", base.replace(**DYN, tiled_loss=True, tiled_mlp=True,
                                              checkpoint="layers", loss_tile=4, mlp_tile=3)),
                      ("budget", base.replace(**DYN, micro_batch=1, token_budget=40, grad_accum=2)),
                      # --packing: rows packed to --seq-len, their documents binned apart
                      ("static packed", base.replace(packing=True)),
                      ("packed", base.replace(packing=True, **DYN)),
                      ("measured", base.replace(sp_schedule="dynamic"))]:  # --cost-model measure (the default)
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
def test_packed_documents_are_binned_apart(runs):
    static, dynamic = runs["static packed"].losses, runs["packed"].losses
    assert [s for s, _ in static] == [s for s, _ in dynamic] == [1, 2, 3]
    for (step, a), (_, b) in zip(static, dynamic, strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(a), f"step {step}: static {a!r} vs dynamic {b!r} (--packing)"
    # every packed row holds --seq-len tokens (a row as a unit would need sp=2): its short documents
    # run at degree 1, and the histogram counts more units than the 3 x 4 rows
    s = runs["packed"]
    assert s.sp_unit == "documents" and s.sp_degrees.get(1, 0) > 0 and sum(s.sp_degrees.values()) > 3 * 4, s.sp_degrees
    assert "documents at sp=1/2: " in format_summary(s)
    with open(s.metrics) as f:
        counts = [sum(m["documents_at_degree"].values()) for m in map(json.loads, f) if "lr" in m]
    assert sum(counts) == sum(s.sp_degrees.values()), counts


@pytest.mark.distributed
def test_a_measured_cost_model(runs):
    # refitted from the model's own bins at the start, the same on every rank (else plan() raises);
    # whatever the schedules it gives, the losses are the static schedule's
    s, static = runs["measured"], runs["static"].losses
    assert [st for st, _ in s.losses] == [st for st, _ in static] == [1, 2, 3]
    for (step, a), (_, b) in zip(static, s.losses, strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(a), f"step {step}: static {a!r} vs measured {b!r}"
    assert s.sp_cost.startswith("measured in ") and "GFLOP/s" in s.sp_cost, s.sp_cost
    assert f"cost model {s.sp_cost}" in format_summary(s)
    assert runs["dynamic"].sp_cost == "builtin (cpu)"


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
    (dict(sp_schedule="dynamic", token_budget=64, micro_batch=2), "leave --micro-batch at 1"),
    (dict(sp_schedule="dynamic", token_budget=31, seq_len=64), "use --token-budget >= 32"),
    (dict(sp_schedule="weekly"), "unknown --sp-schedule 'weekly'"),
    (dict(cost_model="builtin"), "--cost-model chooses a dynamic schedule's cost model: give --sp-schedule dynamic"),
    (dict(sp_schedule="dynamic", token_budget=15, seq_len=30), "use --cost-model builtin or a budget of >= 16"),
    # losses that couple a micro-batch's pairs: a bin holds other pairs than the static micro-batch
    (dict(sp_schedule="dynamic", objective="orpo"), "--objective orpo's NLL term is a token mean over a micro-batch"),
    (dict(sp_schedule="dynamic", objective="dpo", dpo_loss="sigmoid,aot"), "--dpo-loss aot sorts the log-ratios"),
    (dict(sp_schedule="dynamic", objective="dpo", dpo_loss="aot_unpaired"), "--dpo-loss aot_unpaired sorts"),
    (dict(sp_schedule="dynamic", objective="dpo", dpo_loss="sigmoid,sft"), "--dpo-loss sft is the token mean"),
    # a pair of two --seq-len rows is one unit of a bin
    (dict(sp_schedule="dynamic", objective="dpo", token_budget=63, seq_len=64), "a pair of two rows of --seq-len 64 "
     "on --sp 2 ranks: use --token-budget >= 64"),
])
def test_options_that_do_not_combine(changes, needle):
    with pytest.raises(ValueError) as e:
        check_config(TrainConfig(**changes))
    assert needle in str(e.value)


@pytest.mark.parametrize("objective", ["dpo", "simpo", "reward"])
def test_pair_objectives_combine_with_a_dynamic_schedule(objective):
    losses = dict(dpo_loss="sigmoid,ipo,hinge") if objective == "dpo" else {}
    check_config(TrainConfig(sp_schedule="dynamic", objective=objective, **losses))
    check_config(TrainConfig(sp_schedule="dynamic", objective=objective, packing=True, token_budget=32, seq_len=64))


def test_fsdp_and_bfloat16_combine_with_a_dynamic_schedule():
    check_config(TrainConfig(sp_schedule="dynamic", tiled_loss=False, fsdp="on", dtype="bfloat16"))
    dyn, static = TrainConfig(sp_schedule="dynamic"), TrainConfig()
    assert fsdp_options(dyn, torch.bfloat16)["mp_policy"] == fsdp_options(static, torch.bfloat16)["mp_policy"]
    assert fsdp_options(dyn, torch.float32) == {"reshard_after_forward": False}
    assert fsdp_options(static, torch.float32) == {}


def test_the_options_reach_the_command_line():
    from seqpar.cli.main import build_parser

    args = build_parser().parse_args(["train", "--sp-schedule", "dynamic", "--token-budget", "512"])
    assert (args.sp_schedule, args.token_budget) == ("dynamic", 512)


# --fsdp on: the dynamic schedule under FSDP2 (StepBins.fsdp) trains to the static schedule's losses and
# final weights, at 4 ranks: sp=4 with grad-accum micro-steps (bins of degree 1, 2 and 4), dp=2 x sp=2
# (bins of degree 1 and 2) and that first case with LoRA and with the memory switches. --timeout: a
# collective that hangs (a rank waiting on an all-gather its peers never run: the bins without
# StepBins.fsdp, or FSDP2 resharding after each forward) fails the run with gloo's timeout and each
# rank's error in about a minute, not a blocked suite.
WEIGHT_TOL = 1e-9  # float64: the same sums in another order
# AdamW's step lr * g / (sqrt(v) + eps) multiplies a gradient's float64 rounding by up to lr / eps, and
# the next step's gradient carries it on: at the default eps = 1e-8 (x 1e6) the sp4_memory weights came
# 5.7e-10 apart after one step (at an entry with |g| = 1.2 eps) and 4e-9 after two, on an AMD EPYC, with
# the step losses 1e-12 apart. eps = 1e-3 bounds the factor by 10 (measured 3.5e-11 after two steps), so
# the final weights compare the schedules' gradients rather than AdamW's conditioning near g = 0
FSDP_ADAM_EPS = 1e-3
FSDP_CASES = {"sp4_accum2": dict(sp=4, micro_batch=8, grad_accum=2), "dp2_sp2": dict(sp=2, dp=2, micro_batch=6),
              "sp4_lora": dict(sp=4, micro_batch=8, grad_accum=2, lora_r=4),  # a frozen base under FSDP2
              # seqpar train's defaults: the memory switches on, in bins below --sp too
              "sp4_memory": dict(sp=4, micro_batch=8, grad_accum=2, tiled_loss=True, tiled_mlp=True,
                                 checkpoint="layers", loss_tile=4, mlp_tile=3)}
# bfloat16 (FSDP2's mixed precision, the static schedule's policy): the first step's loss, from the same
# weights, differs by the bins' bf16 rounding only (measured 1e-8); later steps follow bf16 gradients
# summed in other orders (measured 3e-5 at step 2; 1e-3 and 2e-3 at steps 2 and 3 of a 3-step run
# without held-out rows), so only the first is held to a bound
BF16_CASE = dict(FSDP_CASES["sp4_accum2"], dtype="bfloat16")
BF16_FIRST_TOL = 1e-5


def _final_weights(checkpoint: str, tmp) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(tmp / "weights.pt")
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)["model"]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dyn_fsdp")
    base = TrainConfig(data=[_jsonl(root / "mixed.jsonl", mid=True)], seq_len=64, steps=2, lr=1e-2, warmup=1, seed=1,
                       dtype="float64", fsdp="on", adam_eps=FSDP_ADAM_EPS, eval_rows=6, eval_every=1, progress=False,
                       plot=False, timeout=120.0,
                       **OFF)  # an evaluation between steps: its forwards leave FSDP2's parameters gathered
    out = {}
    for case, kw in [*FSDP_CASES.items(), ("bf16", BF16_CASE)]:
        for schedule in ("static", "dynamic"):
            d = root / f"{case}_{schedule}"
            s = run_local(prepare_job(base.replace(**_schedule(schedule), save_dir=str(d), **kw)))
            out[case, schedule] = (s, _final_weights(s.checkpoint, root / f"{case}_{schedule}"))
    # --cost-model measure (the default): its probes run forward and backward through the FSDP2 model
    d = root / "measured"
    s = run_local(prepare_job(base.replace(sp_schedule="dynamic", save_dir=str(d), **FSDP_CASES["sp4_accum2"])))
    out["measured"] = (s, _final_weights(s.checkpoint, d))
    return out


@pytest.mark.heavy
@pytest.mark.distributed
def test_a_measured_cost_model_under_fsdp(fsdp_runs):
    (static, w_static), (measured, w_measured) = fsdp_runs["sp4_accum2", "static"], fsdp_runs["measured"]
    assert measured.sp_cost.startswith("measured in "), measured.sp_cost
    for (step, a), (_, b) in zip(static.losses, measured.losses, strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(a), f"step {step}: static {a!r} vs measured {b!r}"
    worst = max(float((w_static[k] - w_measured[k]).abs().max()) for k in w_static)
    assert worst <= WEIGHT_TOL, f"a final weight off by {worst:.3g}"  # the probes' gradients left no trace


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("case", list(FSDP_CASES))
def test_dynamic_under_fsdp_trains_to_the_static_losses_and_weights(fsdp_runs, case):
    (static, w_static), (dynamic, w_dynamic) = fsdp_runs[case, "static"], fsdp_runs[case, "dynamic"]
    assert static.fsdp and dynamic.fsdp and static.world == dynamic.world == 4
    assert [s for s, _ in static.losses] == [s for s, _ in dynamic.losses] == [1, 2]
    for (step, a), (_, b) in zip(static.losses, dynamic.losses, strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(a), f"{case} step {step}: static {a!r} vs dynamic {b!r}"
    assert w_static.keys() == w_dynamic.keys()
    worst = max(float((w_static[k] - w_dynamic[k]).abs().max()) for k in w_static)
    assert worst <= WEIGHT_TOL, f"{case}: a final weight off by {worst:.3g}"
    evals = [(st, e.loss) for st, e in static.evals], [(st, e.loss) for st, e in dynamic.evals]
    assert [st for st, _ in evals[0]] == [st for st, _ in evals[1]] == [1, 2], evals
    assert all(abs(a - b) <= LOSS_TOL * abs(a) for (_, a), (_, b) in zip(*evals, strict=True)), evals
    assert min(dynamic.sp_degrees) == 1 and max(dynamic.sp_degrees) > 1, dynamic.sp_degrees  # bins below sp and not
    if case == "sp4_accum2":
        assert set(dynamic.sp_degrees) == {1, 2, 4}, dynamic.sp_degrees


@pytest.mark.heavy
@pytest.mark.distributed
def test_dynamic_under_bfloat16_mixed_precision(fsdp_runs):
    (static, _), (dynamic, _) = fsdp_runs["bf16", "static"], fsdp_runs["bf16", "dynamic"]
    assert dynamic.fsdp and dynamic.dtype == static.dtype == "bfloat16"
    assert set(dynamic.sp_degrees) == {1, 2, 4}, dynamic.sp_degrees
    a, b = static.losses[0][1], dynamic.losses[0][1]
    assert abs(a - b) <= BF16_FIRST_TOL * abs(a), f"step 1: static {a!r} vs dynamic {b!r}"
    assert all(math.isfinite(loss) for _, loss in dynamic.losses) and len(dynamic.losses) == 2


# --resume under --fsdp on: FSDP2's sharded checkpoint of a dynamic run, its --token-budget steps formed
# again from the data order (2 micro-steps each), continue the uninterrupted run: the same losses, the
# same bins per step (rows at each degree, tokens) and the same final weights, float64 at sp=4
@pytest.mark.distributed
def test_dynamic_under_fsdp_resumes_to_the_uninterrupted_run(tmp_path):
    cfg = TrainConfig(data=[_jsonl(tmp_path / "mixed.jsonl", mid=True)], seq_len=64, sp=4, fsdp="on",
                      **DYN, micro_batch=1, token_budget=40, grad_accum=2, steps=3, save_every=0,
                      lr=1e-2, warmup=1, seed=1, dtype="float64", eval_rows=0, progress=False, plot=False,
                      timeout=120.0, **OFF)
    straight = run_local(prepare_job(cfg.replace(save_dir=str(tmp_path / "straight"))))
    first = run_local(prepare_job(cfg.replace(save_dir=str(tmp_path / "parts"))), stop_after=1)  # saves step 1
    resumed = run_local(prepare_job(cfg.replace(save_dir=str(tmp_path / "parts"), resume=True)))
    assert first.steps == 1 and resumed.resumed_step == 1 and resumed.fsdp and resumed.world == 4
    assert [s for s, _ in resumed.losses] == [2, 3]
    for (step, a), (_, b) in zip(straight.losses[1:], resumed.losses, strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(a), f"step {step}: uninterrupted {a!r} vs resumed {b!r}"

    def bins(summary) -> list[tuple]:
        with open(summary.metrics) as f:
            return [(m["step"], m["rows_at_degree"], m["tokens"]) for m in map(json.loads, f) if "lr" in m]

    assert bins(straight) == bins(resumed) and len(bins(straight)) == 3, (bins(straight), bins(resumed))
    assert max(straight.sp_degrees) > 1 and min(straight.sp_degrees) == 1, straight.sp_degrees
    w_straight = _final_weights(straight.checkpoint, tmp_path / "straight")
    w_resumed = _final_weights(resumed.checkpoint, tmp_path / "parts")
    assert w_straight.keys() == w_resumed.keys()
    worst = max(float((w_straight[k] - w_resumed[k]).abs().max()) for k in w_straight)
    assert worst <= WEIGHT_TOL, f"a final weight off by {worst:.3g}"


# Preference objectives: a bin holds whole pairs (chosen and rejected packed as two documents), each
# bin's loss is its pairs' share of the step's mean over pairs, its sequences' sums reduced over the
# bin's block of ranks; the reference runs on the same bin. Pairs of mixed lengths: short pairs at
# sp=1, long ones (more tokens than one rank's budget) at sp=2.
def _pairs_jsonl(path) -> str:
    rng = random.Random(5)

    def text(lo: int, hi: int) -> str:
        return "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(lo, hi)))

    with open(path, "w") as f:
        for _ in range(40):
            long = rng.random() < 0.3
            f.write(json.dumps({"prompt": text(4, 12), "chosen": " " + text(30, 45) if long else " " + text(2, 8),
                                "rejected": " " + text(2, 10) if rng.random() < 0.5 else " " + text(25, 40)}) + "\n")
    return str(path)


PAIR_OBJECTIVES = {"dpo": dict(objective="dpo", dpo_loss="sigmoid,ipo"), "simpo": dict(objective="simpo"),
                   "reward": dict(objective="reward")}


@pytest.fixture(scope="module")
def pair_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dynpairs")
    base = TrainConfig(data=[_pairs_jsonl(root / "pairs.jsonl")], seq_len=64, sp=2, micro_batch=4, grad_accum=2,
                       steps=3, lr=1e-2, warmup=1, dtype="float64", eval_rows=0, progress=False, plot=False, seed=1,
                       **OFF)
    out = {}
    for name, changes in PAIR_OBJECTIVES.items():
        for schedule in ("static", "dynamic"):
            cfg = base.replace(**_schedule(schedule), save_dir=str(root / f"{name}_{schedule}"), **changes)
            out[name, schedule] = run_local(prepare_job(cfg))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(PAIR_OBJECTIVES))
def test_preference_objectives_train_to_the_static_losses(pair_runs, name):
    static, dynamic = pair_runs[name, "static"], pair_runs[name, "dynamic"]
    assert [s for s, _ in static.losses] == [s for s, _ in dynamic.losses] == [1, 2, 3]
    for (step, a), (_, b) in zip(static.losses, dynamic.losses, strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(a), f"{name} step {step}: static {a!r} vs dynamic {b!r}"
    assert set(dynamic.sp_degrees) == {1, 2}, dynamic.sp_degrees  # short pairs at sp=1, long ones at sp=2
    # the histogram counts rows, as its words say: a pair is two (chosen and rejected, one bin, one degree)
    assert sum(dynamic.sp_degrees.values()) == 3 * 2 * 4 * 2  # steps x micro-steps x pairs x 2 rows
    assert f"rows at sp=1/2: {dynamic.sp_degrees[1]}/{dynamic.sp_degrees[2]}" in format_summary(dynamic)
    with open(dynamic.metrics) as f:
        assert [sum(m["rows_at_degree"].values()) for m in map(json.loads, f) if "lr" in m] == [16] * 3
    _assert_same_metrics(static, dynamic, name)


METRICS_TOL = 1e-12  # float64: the same pair-weighted sums in another order (relative; near 0, 1e-15 absolute)


def _step_metrics(summary) -> list[dict]:
    """metrics.jsonl's objective metrics (rewards/..., logps/..., accuracy, margin) of each step."""
    keep = ("rewards/", "logps/", "accuracy", "margin")
    with open(summary.metrics) as f:
        return [{k: v for k, v in m.items() if k.startswith(keep)} for m in map(json.loads, f) if "lr" in m]


def _assert_same_metrics(static, dynamic, name: str) -> None:
    """The objective's metrics of each step: the dynamic schedule's (every rank's bins) equal the static
    schedule's (every dp rank's micro-batches), both over every pair of the step."""
    a, b = _step_metrics(static), _step_metrics(dynamic)
    assert len(a) == len(b) == 3 and all(a) and a[0].keys() == b[0].keys(), (a, b)
    for step, (ma, mb) in enumerate(zip(a, b, strict=True), 1):
        for k in ma:
            assert abs(ma[k] - mb[k]) <= METRICS_TOL * max(abs(ma[k]), 1e-3), f"{name} step {step} {k}: {ma[k]!r} " \
                f"vs {mb[k]!r}"


# heavy (4 ranks): degrees 1, 2 and 4 at sp=4; dp=2 x sp=2; FSDP2 with the flush pass of a pair (a
# reference with LoRA's adapters off for dpo, a new score head for reward); --packing (several pairs a row)
PAIR_HEAVY = {"sp4": dict(sp=4), "dp2_sp2": dict(sp=2, dp=2), "packed": dict(packing=True, seq_len=128, micro_batch=1),
              "fsdp_lora": dict(sp=4, fsdp="on", lora_r=4)}


@pytest.fixture(scope="module")
def pair_heavy_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dynpairs_heavy")
    base = TrainConfig(data=[_pairs_jsonl(root / "pairs.jsonl")], seq_len=64, micro_batch=4, grad_accum=2, steps=3,
                       lr=1e-2, warmup=1, dtype="float64", eval_rows=0, progress=False, plot=False, seed=1,
                       timeout=120.0, **OFF)
    out = {}
    for case, kw in PAIR_HEAVY.items():
        for name, changes in PAIR_OBJECTIVES.items():
            if name == "reward" and "lora_r" in kw:  # reward trains its new head: no LoRA (a frozen copy under FSDP2
                kw = {k: v for k, v in kw.items() if k != "lora_r"}  # is refused, the head needs none)
            for schedule in ("static", "dynamic"):
                cfg = base.replace(**_schedule(schedule), save_dir=str(root / f"{case}_{name}_{schedule}"), **kw,
                                   **changes)
                out[case, name, schedule] = run_local(prepare_job(cfg))
    return out


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("case", list(PAIR_HEAVY))
@pytest.mark.parametrize("name", list(PAIR_OBJECTIVES))
def test_preference_objectives_at_four_ranks(pair_heavy_runs, case, name):
    static, dynamic = pair_heavy_runs[case, name, "static"], pair_heavy_runs[case, name, "dynamic"]
    assert [s for s, _ in static.losses] == [s for s, _ in dynamic.losses] == [1, 2, 3]
    for (step, a), (_, b) in zip(static.losses, dynamic.losses, strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(a), f"{case} {name} step {step}: static {a!r} vs dynamic {b!r}"
    want = {1, 2, 4} if PAIR_HEAVY[case].get("sp") == 4 else {1, 2}
    assert set(dynamic.sp_degrees) == want, dynamic.sp_degrees
    kw = PAIR_HEAVY[case]  # rows: 2 per pair of padded rows, 1 per --packing row (of several pairs)
    units = 3 * 2 * kw.get("dp", 1) * kw.get("micro_batch", 4)
    assert sum(dynamic.sp_degrees.values()) == units * (1 if kw.get("packing") else 2), dynamic.sp_degrees
    _assert_same_metrics(static, dynamic, f"{case} {name}")
