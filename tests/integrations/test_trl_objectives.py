"""TRL's DPOTrainer, RewardTrainer and GRPOTrainer under ``seqpar.parallelize_trainer`` (issue 36 item 7).

Each case is one user script, run twice: in this process without seqpar (the reference) and on gloo
workers with the one added line ``parallelize_trainer(trainer, sp=P)``. The default suite runs one
case per trainer (two for DPO) at P=2; ``-m heavy`` every case at P=2 and 3. Tiny float64 models, rows
of odd lengths (pairs and completions split across the shards), one SGD step: the logged loss must
agree to 1e-9, every weight after the step to 1e-8, every other metric TRL logs (rewards, margins,
log-probs, entropy, token counts, GRPO's completion lengths and reward statistics...) to 1e-9, DPO's
eval metrics and predicted logits to 1e-9. GRPO samples its completions on every rank from the seed:
equal completions are what make its metrics and weights equal. The workers start once per P and run
every case in one go.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from seqpar.comm.launch import run_distributed

LOSS_TOL, WEIGHT_TOL, METRIC_TOL = 1e-9, 1e-8, 1e-9
VOCAB = 64
ROWS = 4  # pairs per step (one dp rank)
# TRL's fused LM head accumulates the LM head's weight gradient in float32 even for a float64 model
# (its kernel's fp32 GEMM accumulators), over whichever tokens a process holds: the script without
# seqpar carries that rounding itself, ~6e-8 x |grad| (measured: 4e-8 on a gradient of norm 10). A
# step moves the weights by LR x that: LR=0.01 keeps the step visible (the test checks that the
# weights moved by more than 1e-4) and the baseline's own rounding under WEIGHT_TOL. For the same
# reason the logged grad_norm is compared to float32's relative precision, every other metric to 1e-9.
LR = 0.01
GRAD_NORM_RTOL = 2.0 ** -23


# ---------------------------------------------------------------------------------------------
# the script: data, models, trainer -- the same with and without seqpar
# ---------------------------------------------------------------------------------------------

def _ids(g: torch.Generator, lo: int, hi: int) -> list[int]:
    return torch.randint(3, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()


def _pairs(seed: int, dp: int = 1) -> list[dict]:
    """Preference rows of word-level tokens: a prompt of 3..9 tokens, completions of 2..11."""
    g = torch.Generator().manual_seed(seed)
    return [{k: " ".join(f"t{i}" for i in _ids(g, *span)) for k, span in
             (("prompt", (3, 9)), ("chosen", (2, 11)), ("rejected", (2, 11)))} for _ in range(ROWS * dp)]


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def _causal_lm(seed: int = 0):
    from seqpar.integrations.models import build_model

    torch.manual_seed(seed)
    model, _ = build_model("tiny-llama", dtype=torch.float64, vocab_size=VOCAB)
    return model


def _reward_model():
    from transformers import LlamaForSequenceClassification

    config = copy.deepcopy(_causal_lm().config)
    config.num_labels, config.pad_token_id = 1, 0
    torch.manual_seed(1)
    return LlamaForSequenceClassification(config).to(torch.float64)


def _common(out: str, accum: int = 1) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=ROWS, gradient_accumulation_steps=accum, max_steps=1,
                learning_rate=LR, optim="sgd",
                max_grad_norm=0.0, logging_steps=1, report_to=[], use_cpu=True, bf16=False, seed=0,
                disable_tqdm=True, save_strategy="no", lr_scheduler_type="constant")


DPO_CASES = {
    "dpo-sigmoid": dict(loss_type=["sigmoid"]),
    "dpo-ipo+sft": dict(loss_type=["ipo", "sft"], loss_weights=[1.0, 0.5], beta=0.2),
    "dpo-robust-precomputed": dict(loss_type=["robust"], label_smoothing=0.1, precompute_ref_log_probs=True),
    "dpo-weighted-ld": dict(loss_type=["sigmoid", "nca_pair"], use_weighting=True, ld_alpha=0.5),
}
REWARD_CASES = {
    "reward": dict(),
    "reward-margin-centered": dict(center_rewards_coefficient=0.01),
}
GRPO_CASES = {
    "grpo-dapo": dict(),
    "grpo-grpo-batch-scaled": dict(loss_type="grpo", scale_rewards="batch"),
    "grpo-dr_grpo": dict(loss_type="dr_grpo", epsilon_high=0.28),
    # two micro-batches of one generation batch, each trained on twice (old log-probs from generation)
    "grpo-iterations-accumulation": dict(num_iterations=2, gradient_accumulation_steps=2),
}
CASES = [*DPO_CASES, *REWARD_CASES, *GRPO_CASES]
# make test: one case per trainer with its richest options (~35 s); -m heavy: every case at sp=2 and 3
DEFAULT_CASES = ["dpo-sigmoid", "dpo-ipo+sft", "reward-margin-centered", "grpo-grpo-batch-scaled"]


def _reward(completions, **kwargs) -> list[float]:
    """A deterministic reward that differs between completions of one prompt."""
    return [sum(int(w[1:]) % 5 for w in c.split() if w[1:].isdigit()) / 10 for c in completions]


def train(case: str, out: str, sp: int | None = None, dp: int = 1, *, accum: int = 1, line=None) -> dict:
    """One step of ``case``; with ``sp`` the one seqpar line is added (or ``line(trainer)``, another
    one: test_trl_dynamic's). ``accum``: micro-batches per step (their rows: dp x accum x ROWS pairs).
    Returns the logged loss and metrics and the weights after the step."""
    import seqpar

    if case in DPO_CASES:
        from trl import DPOConfig, DPOTrainer

        extra = DPO_CASES[case]
        model = _causal_lm()
        # a reference other than the policy's start, so that rewards and margins are not all 0
        ref = None if extra.get("precompute_ref_log_probs") else _causal_lm(seed=2)
        # eval at dp=1 (at dp > 1 seqpar refuses it: every rank evaluates every batch)
        evals = {"eval_dataset": _dataset(_pairs(3), out)} if case == "dpo-sigmoid" and dp == 1 else {}
        data = _dataset(_pairs(1, dp * accum), out, on_disk=ref is None)
        trainer = DPOTrainer(model=model, ref_model=ref, args=DPOConfig(**_common(out, accum), **extra),
                             train_dataset=data, processing_class=_tokenizer(), **evals)
    elif case in GRPO_CASES:
        from trl import GRPOConfig, GRPOTrainer

        model = _causal_lm()
        prompts = [{"prompt": r["prompt"]} for r in _pairs(4, dp)]
        args = GRPOConfig(**{**_common(out), **GRPO_CASES[case]}, num_generations=ROWS, max_completion_length=7,
                          shuffle_dataset=False)  # a case's own gradient_accumulation_steps wins
        trainer = GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=_dataset(prompts, out),
                              processing_class=_tokenizer())
    else:
        from trl import RewardConfig, RewardTrainer

        rows = [{"chosen": f"{r['prompt']} {r['chosen']}", "rejected": f"{r['prompt']} {r['rejected']}"}
                for r in _pairs(2, dp * accum)]
        if case == "reward-margin-centered":
            rows = [{**r, "margin": 0.25 * i} for i, r in enumerate(rows)]
        model = _reward_model()
        trainer = RewardTrainer(model=model, args=RewardConfig(**{**_common(out, accum), **REWARD_CASES[case]}),
                                train_dataset=_dataset(rows, out), processing_class=_tokenizer())
    if line is not None:
        line(trainer)
    elif sp is not None:
        seqpar.parallelize_trainer(trainer, sp=sp)  # the line a user adds
    result = {}
    if trainer.eval_dataset is not None:  # before the step, on equal weights: loss, TRL's metrics, logits
        timing = ("runtime", "per_second")
        result["eval"] = {k: float(v) for k, v in trainer.evaluate().items() if not any(t in k for t in timing)}
        result["predict"] = torch.as_tensor(trainer.predict(trainer.eval_dataset).predictions)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 1, logs
    metrics = {k: float(v) for k, v in logs[0].items()
               if isinstance(v, (int, float)) and k not in ("epoch", "step", "step_time")}  # step_time: a timing
    return {**result, "metrics": metrics, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _dataset(rows: list[dict], out: str, on_disk: bool = False):
    """The rows as a datasets.Dataset; ``on_disk``: saved and loaded back, so that its cache files
    live where every process finds them (TRL's precomputed reference log-probs are one, written by
    the main process and read by the others)."""
    import torch.distributed as dist
    from datasets import Dataset, load_from_disk

    data = Dataset.from_list(rows)
    if not on_disk:
        return data
    path = os.path.join(out, "data")
    if not dist.is_initialized() or dist.get_rank() == 0:
        data.save_to_disk(path)
    if dist.is_initialized():
        dist.barrier()
    return load_from_disk(path)


def _worker(rank: int, world: int, out: str, cases: list[str], sp: int | None = -1, dp: int = 1) -> dict:
    """``sp=-1``: sp = the world; None: the script without seqpar (on ``world`` = dp processes)."""
    torch.set_num_threads(1)
    sp = world if sp == -1 else sp
    return {case: train(case, os.path.join(out, case), sp=sp, dp=dp) for case in cases}


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------

def _run(world: int, cases: list[str], out: str) -> tuple[int, list[dict], dict]:
    """(P, every rank's results, the single-process references) of ``cases``, one worker start."""
    results = run_distributed(_worker, world, out, cases, timeout=600.0)
    return world, results, {case: train(case, os.path.join(out, f"ref-{case}")) for case in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The default suite's cases at sp=2 (the grid at sp=2 and 3: heavy_runs)."""
    return _run(2, DEFAULT_CASES, str(tmp_path_factory.mktemp("trl2")))


@pytest.fixture(scope="module", params=[2, 3], ids=["sp2", "sp3"])
def heavy_runs(request, tmp_path_factory):
    return _run(request.param, CASES, str(tmp_path_factory.mktemp(f"trl{request.param}-all")))


@pytest.mark.distributed
@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_one_step_equals_the_script_without_seqpar(runs, case):
    check_case(runs, case)


@pytest.mark.distributed
@pytest.mark.heavy
@pytest.mark.parametrize("case", CASES)
def test_every_case_at_sp2_and_sp3(heavy_runs, case):
    check_case(heavy_runs, case)


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """dp=2 x sp=2 (4 processes) against the same script on 2 processes without seqpar."""
    out = str(tmp_path_factory.mktemp("trl-dp2"))
    results = run_distributed(_worker, 4, os.path.join(out, "seqpar"), CASES, 2, 2, timeout=900.0)
    plain = run_distributed(_worker, 2, os.path.join(out, "plain"), CASES, None, 2, timeout=900.0)
    assert all(_same(plain[0][case], plain[1][case]) for case in CASES)
    return 4, results, plain[0]


def _same(a: dict, b: dict) -> bool:
    return a["metrics"] == b["metrics"] and all(torch.equal(a["weights"][n], w) for n, w in b["weights"].items())


@pytest.mark.distributed
@pytest.mark.heavy
@pytest.mark.parametrize("case", CASES)
def test_dp2_sp2_equals_the_script_on_two_processes(dp_runs, case):
    # the plain script on 2 processes logs the float32 mean of their two float32 losses (the Trainer's
    # running loss is float32), which rounds; seqpar's log averages the same losses exactly: its
    # logged loss may differ from the plain script's by that rounding, one float32 ulp (measured:
    # 1 ulp in 3 of 9 cases), and nothing else does
    check_case(dp_runs, case, loss_rtol=2.0 ** -23)


def check_case(runs: tuple[int, list[dict], dict], case: str, loss_rtol: float = 0.0,
               start: dict | None = None, grad_norm_rtol: float = GRAD_NORM_RTOL) -> None:
    """``start``: the weights before the step (default: the case's model as built here)."""
    world, results, refs = runs
    ref = refs[case]
    keys = set(ref["metrics"])
    expect = {"dpo": "rewards/margins", "reward": "margin", "grpo": "reward_std", "rloo": "reward_std",
              "kto": "rewards/margins"}[case.split("-")[0]]
    assert "loss" in keys and expect in keys, keys
    for rank, res in enumerate(results):
        got = res[case]
        assert set(got["metrics"]) == keys, f"P={world} rank {rank} {case}: logged {sorted(got['metrics'])}"
        for key, want in ref["metrics"].items():
            err = abs(got["metrics"][key] - want)
            if key == "grad_norm":
                tol = grad_norm_rtol * abs(want)
            elif key == "loss" and loss_rtol:
                tol = loss_rtol * abs(want)
            else:
                tol = LOSS_TOL if key == "loss" else METRIC_TOL
            assert err <= tol, f"P={world} rank {rank} {case} {key}: {got['metrics'][key]} vs {want}"
        for name, w in ref["weights"].items():
            err = float((got["weights"][name] - w).abs().max())
            assert err <= WEIGHT_TOL, f"P={world} rank {rank} {case} weight {name}: max difference {err:.3g}"
    if "eval" in ref:
        for rank, res in enumerate(results):
            got = res[case]
            assert set(got["eval"]) == set(ref["eval"]), f"P={world} rank {rank} {case}: eval {sorted(got['eval'])}"
            for key, want in ref["eval"].items():
                assert abs(got["eval"][key] - want) <= METRIC_TOL, f"P={world} rank {rank} {case} {key}"
            err = float((got["predict"] - ref["predict"]).abs().max())
            assert got["predict"].shape == ref["predict"].shape and err <= METRIC_TOL, f"{case} predict: {err:.3g}"
    if start is None:
        start = (_reward_model() if case.startswith("reward") else _causal_lm()).state_dict()
    moved = max(float((w - start[n]).abs().max()) for n, w in ref["weights"].items())
    assert moved > 1e-4, f"{case}: the step did not move the weights ({moved:.3g})"


@pytest.mark.parametrize("option", ["use_liger_kernel", "compute_loss_func"])
def test_refuses_trl_options_by_name(option):
    from types import SimpleNamespace

    from trl import DPOTrainer

    import seqpar
    from seqpar.integrations.trl.mixins import check_trl_options

    trainer = object.__new__(DPOTrainer)
    trainer.args = SimpleNamespace(use_liger_kernel=option == "use_liger_kernel")
    trainer.compute_loss_func = (lambda *a: 0) if option == "compute_loss_func" else None
    trainer.ref_model, trainer.precompute_ref_logps, trainer.model = object(), False, torch.nn.Linear(1, 1)
    with pytest.raises(seqpar.Refused, match=option):
        check_trl_options(trainer)


@pytest.mark.parametrize("option,value", [("use_vllm", True), ("eval_strategy", "steps")])
def test_refuses_grpo_options_by_name(option, value):
    from types import SimpleNamespace

    import seqpar
    from seqpar.integrations.trl.grpo import check_grpo_options

    args = SimpleNamespace(use_vllm=False, beta=0.0, use_liger_kernel=False, eval_strategy="no")
    check_grpo_options(SimpleNamespace(args=args, tools=None, rollout_func=None))  # the defaults pass
    setattr(args, option, value)
    with pytest.raises(seqpar.Refused, match=option):
        check_grpo_options(SimpleNamespace(args=args, tools=None, rollout_func=None))
