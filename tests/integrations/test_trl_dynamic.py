"""TRL's DPOTrainer and RewardTrainer under a dynamic SP schedule (``parallelize_trainer(trainer, mesh,
schedule=DynamicSP(...))``): one optimizer step of two micro-batches (8 pairs) on gloo workers, every
rank reading every pair, each bin holding whole pairs at degree 1 or 2 (sp=2; ``-m heavy``: 1, 2 and
4 at sp=4 on 4 ranks), equals test_trl_objectives' script without seqpar in one process: the logged
loss and every weight after the step (float64 models, LR as there). TRL's fused LM head computes the
DPO log-probs in float32 whatever the model's dtype, so a bin's loss (TRL's float32 mean over the
bin's pairs) regroups float32 roundings the script's micro-batch mean does in another order: DPO's
loss is compared to float32's precision (``DPO_LOSS_RTOL``), the reward trainer's (float64 scores)
to 1e-9. TRL's other metrics are per rank under a dynamic schedule and not compared. What stays
refused is refused by name."""

from __future__ import annotations

import os

import pytest
import test_trl_objectives as script
import torch

from seqpar.comm.launch import run_distributed

BUDGET = 24  # tokens per rank per bin: a pair (chosen + rejected) has 14..33 real tokens here
DPO_LOSS_RTOL = 4 * 2.0 ** -23  # a few float32 roundings (see the module doc)
CASES = ["dpo-sigmoid", "dpo-weighted-ld", "dpo-robust-precomputed", "reward", "reward-margin-centered"]
DEFAULT_CASES = ["dpo-sigmoid", "reward-margin-centered"]


def _schedule(mesh, world: int):
    from seqpar.planner.bins import DynamicSP

    def cost(docs, k):  # a sub-group only for pairs that do not fit fewer ranks
        return sum(docs) / k + (50.0 if k > 1 else 0.0)

    return DynamicSP(mesh, token_budget=BUDGET, cost=cost)


def _worker(rank: int, world: int, out: str, cases: list[str]) -> dict:
    torch.set_num_threads(1)
    import seqpar

    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    results, seen = {}, {}
    for case in cases:
        def line(trainer, case=case):
            seqpar.parallelize_trainer(trainer, mesh, schedule=_schedule(mesh, world))
            seen[case] = trainer

        results[case] = script.train(case, os.path.join(out, case), accum=2, line=line)
        results[case]["degrees"] = dict(seen[case].rows_at_degree)
    results["bad"] = _bad(mesh, world, os.path.join(out, "bad"))
    return results


def _bad(mesh, world: int, out: str) -> dict:
    """The refusals' messages: DPO's batch-coupled loss types and GRPO."""
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    import seqpar

    seen = {}
    data = script._dataset(script._pairs(1), out)
    for name in ("aot", "sft", "grpo"):
        if name == "grpo":
            prompts = script._dataset([{"prompt": r["prompt"]} for r in script._pairs(4)], out)
            trainer = GRPOTrainer(model=script._causal_lm(), reward_funcs=script._reward, train_dataset=prompts,
                                  args=GRPOConfig(**script._common(out), num_generations=script.ROWS,
                                                  max_completion_length=7),
                                  processing_class=script._tokenizer())
        else:
            trainer = DPOTrainer(model=script._causal_lm(), ref_model=script._causal_lm(seed=2), train_dataset=data,
                                 args=DPOConfig(**script._common(out), loss_type=["sigmoid", name]),
                                 processing_class=script._tokenizer())
        try:
            seqpar.parallelize_trainer(trainer, mesh, schedule=_schedule(mesh, world))
            seen[name] = None
        except ValueError as e:
            seen[name] = f"{type(e).__name__}: {e}"
    return seen


def _run(world: int, cases: list[str], out: str) -> tuple[int, list[dict], dict]:
    results = run_distributed(_worker, world, out, cases, timeout=900.0)
    return world, results, {case: script.train(case, os.path.join(out, f"ref-{case}"), accum=2) for case in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _run(2, DEFAULT_CASES, str(tmp_path_factory.mktemp("trl-dyn2")))


@pytest.fixture(scope="module")
def heavy_runs(tmp_path_factory):
    return _run(4, CASES, str(tmp_path_factory.mktemp("trl-dyn4")))


@pytest.mark.distributed
@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_one_dynamic_step_equals_the_script_without_seqpar(runs, case):
    check_case(runs, case, degrees={1, 2})


@pytest.mark.distributed
@pytest.mark.heavy
@pytest.mark.parametrize("case", CASES)
def test_every_case_at_sp4(heavy_runs, case):
    check_case(heavy_runs, case, degrees={1, 2, 4})


@pytest.mark.distributed
def test_what_stays_refused_is_refused_by_name(runs):
    _, results, _ = runs
    for res in results:
        bad = res["bad"]
        assert "DPO's loss_type 'aot' sorts the log-ratios over the micro-batch" in bad["aot"], bad["aot"]
        assert "DPO's loss_type 'sft' is the token mean" in bad["sft"], bad["sft"]
        assert "with TRL's GRPOTrainer is not supported" in bad["grpo"], bad["grpo"]
        assert all(m.startswith("Refused: ") for m in bad.values()), bad  # what seqpar cannot make exact


def check_case(runs: tuple[int, list[dict], dict], case: str, degrees: set[int]) -> None:
    world, results, refs = runs
    ref = refs[case]
    want = ref["metrics"]["loss"]
    tol = DPO_LOSS_RTOL * abs(want) if case.startswith("dpo") else script.LOSS_TOL
    for rank, res in enumerate(results):
        got = res[case]
        assert set(got["degrees"]) <= degrees and sum(got["degrees"].values()) == 2 * script.ROWS, got["degrees"]
        err = abs(got["metrics"]["loss"] - want)
        assert err <= tol, f"P={world} rank {rank} {case} loss: {got['metrics']['loss']!r} vs {want!r}"
        for name, w in ref["weights"].items():
            err = float((got["weights"][name] - w).abs().max())
            assert err <= script.WEIGHT_TOL, f"P={world} rank {rank} {case} weight {name}: max difference {err:.3g}"
    assert len(set().union(*(r[case]["degrees"] for r in results))) > 1, "every pair ran at one degree"
    start = (script._reward_model() if case.startswith("reward") else script._causal_lm()).state_dict()
    moved = max(float((w - start[n]).abs().max()) for n, w in ref["weights"].items())
    assert moved > 1e-4, f"{case}: the step did not move the weights ({moved:.3g})"
