"""TRL's GRPOTrainer with a KL to a reference (beta != 0), RLOOTrainer and KTOTrainer under
``seqpar.parallelize_trainer`` (issue 49 items 1-2), held as test_trl_objectives holds DPO / reward /
GRPO at beta 0: one user script, run in this process without seqpar and on gloo workers with the one
added line; tiny float64 models, odd lengths, one SGD step; the logged loss to 1e-9, every weight
after the step to 1e-8, every other metric TRL logs (kl, rewards, advantages' statistics, entropy,
clip ratios, KTO's rewards / log-probs / logits...) to 1e-9.

The policy starts away from its reference, so the KL term and its gradient are not 0 on the first
step: GRPO / RLOO load their reference from the policy's checkpoint (``config.name_or_path``, as TRL
does for a model passed as an instance) while the policy itself was trained further (other weights);
with peft the reference is the model with its adapters off (adapters initialised away from 0).
TRL's fused LM head keeps float32 statistics in float64 (see test_trl_objectives' LR): the same
float32 passes run in both scripts, and only the logged grad_norm is compared to float32 precision.
"""

from __future__ import annotations

import os

import pytest
import test_trl_objectives as script
import torch

from seqpar.comm.launch import run_distributed

GRPO_CASES = {
    "grpo-beta": dict(beta=0.1, loss_type="dapo"),
    "grpo-beta-grpo-iterations": dict(beta=0.1, loss_type="grpo", num_iterations=2, gradient_accumulation_steps=2),
    "grpo-beta-peft": dict(beta=0.04, loss_type="bnpo"),
}
RLOO_CASES = {
    "rloo-beta": dict(beta=0.1),
    "rloo-normalized-iterations": dict(beta=0.05, normalize_advantages=True, num_iterations=2,
                                       gradient_accumulation_steps=2),
}
KTO_CASES = {
    "kto": dict(loss_type="kto"),
    "kto-apo-weighted": dict(loss_type="apo_zero_unpaired", desirable_weight=1.3, undesirable_weight=0.7),
    "kto-precomputed": dict(loss_type="kto", precompute_ref_log_probs=True),
}
CASES = [*GRPO_CASES, *RLOO_CASES, *KTO_CASES]
DEFAULT_CASES = ["grpo-beta", "rloo-beta", "kto"]  # make test (~40 s); -m heavy: every case at sp=2, 3, dp2 x sp2
EXPECT = {"grpo": "kl", "rloo": "kl", "kto": "rewards/chosen"}
# TRL's fused LM head returns float32 log-probs (and takes a float32 gradient) even in a float64 model.
# seqpar scales the gradient of this rank's slice by sp (for the average over the SP ranks): exact in
# float32 for sp a power of two, one float32 rounding per element at sp=3. A LoRA model's every
# gradient passes through that float32 gradient (its LM head is frozen), so its logged grad_norm moves
# by it: measured 1.77e-7 relative (1.5 float32 ulps) at sp=3, weights 3e-10 apart (under 1e-8), loss
# and every other metric within 1e-9. Elsewhere grad_norm is held to one ulp (test_trl_objectives).
PEFT_GRAD_NORM_RTOL = 4 * 2.0 ** -23


def _policy_with_reference(out: str):
    """The policy and, in ``name_or_path``, the checkpoint TRL loads its reference from (other weights),
    written once (transformers saves on the main process only)."""
    import torch.distributed as dist

    ref_dir = os.path.join(out, "reference")
    if not dist.is_initialized() or dist.get_rank() == 0:
        script._causal_lm(seed=2).save_pretrained(ref_dir)
    if dist.is_initialized():
        dist.barrier()
    model = script._causal_lm()
    model.config.name_or_path = ref_dir
    return model


def _lora():
    """TRL adds the adapter (its reference: the adapters off); initialised away from 0, so the policy
    is not its reference on the first step."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def _unpaired(seed: int, dp: int) -> list[dict]:
    """KTO's rows: each pair's chosen completion desirable, its rejected one not, interleaved."""
    rows = []
    for r in script._pairs(seed, dp):
        rows += [{"prompt": r["prompt"], "completion": r["chosen"], "label": True},
                 {"prompt": r["prompt"], "completion": r["rejected"], "label": False}]
    return rows[: script.ROWS * dp * 2]


def build(case: str, out: str, dp: int = 1):
    """The trainer of ``case`` (and the model whose weights are compared)."""
    common = script._common(out)
    if case in KTO_CASES:
        from trl import KTOConfig, KTOTrainer

        model = script._causal_lm()
        extra = KTO_CASES[case]
        ref = script._causal_lm(seed=2)  # precompute_ref_log_probs: TRL runs it before seqpar is applied
        data = script._dataset(_unpaired(5, dp), out, on_disk=bool(extra.get("precompute_ref_log_probs")))
        args = KTOConfig(**common, **extra)
        return KTOTrainer(model=model, ref_model=ref, args=args, train_dataset=data,
                          processing_class=script._tokenizer()), model
    prompts = [{"prompt": r["prompt"]} for r in script._pairs(4, dp)]
    if case in GRPO_CASES:
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer

        extra = GRPO_CASES[case]
    else:
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer

        extra = RLOO_CASES[case]
    model = script._causal_lm() if case.endswith("peft") else _policy_with_reference(out)
    args = Config(**{**common, **extra}, num_generations=script.ROWS, max_completion_length=7, shuffle_dataset=False)
    peft = {"peft_config": _lora()} if case.endswith("peft") else {}
    trainer = Trainer(model=model, reward_funcs=script._reward, args=args, train_dataset=script._dataset(prompts, out),
                      processing_class=script._tokenizer(), **peft)
    return trainer, model  # peft adds its adapters into the model's modules: their weights are compared too


def train(case: str, out: str, sp: int | None = None, dp: int = 1) -> dict:
    """One step of ``case``; with ``sp`` the one seqpar line is added. Returns the logged loss and
    metrics and the model's weights after the step."""
    import seqpar

    os.makedirs(out, exist_ok=True)
    trainer, model = build(case, out, dp)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    if sp is not None:
        seqpar.parallelize_trainer(trainer, sp=sp)  # the line a user adds
    trainer.train()
    ref = getattr(trainer, "ref_model", None)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 1, logs
    metrics = {k: float(v) for k, v in logs[0].items()
               if isinstance(v, (int, float)) and k not in ("epoch", "step", "step_time")}
    return {"metrics": metrics, "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "start": start, "ref_parallelized": ref is not None and _parallelized(trainer, ref)}


def _parallelized(trainer, ref) -> bool:
    """The reference model runs sharded: it is parallelized (a whole-batch call would not run)."""
    from seqpar.integrations.peft import unwrap_peft
    from seqpar.integrations.state import state_of

    record = state_of(unwrap_peft(trainer.accelerator.unwrap_model(ref)))
    return record is not None and record.parallel is not None


def _worker(rank: int, world: int, out: str, cases: list[str], sp: int | None = -1, dp: int = 1) -> dict:
    torch.set_num_threads(1)
    sp = world if sp == -1 else sp
    return {case: train(case, os.path.join(out, case), sp=sp, dp=dp) for case in cases}


def _run(world: int, cases: list[str], out: str) -> tuple[int, list[dict], dict]:
    results = run_distributed(_worker, world, out, cases, timeout=600.0)
    return world, results, {case: train(case, os.path.join(out, f"ref-{case}")) for case in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _run(2, DEFAULT_CASES, str(tmp_path_factory.mktemp("trl-rl2")))


@pytest.fixture(scope="module", params=[2, 3], ids=["sp2", "sp3"])
def heavy_runs(request, tmp_path_factory):
    return _run(request.param, CASES, str(tmp_path_factory.mktemp(f"trl-rl{request.param}-all")))


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """dp=2 x sp=2 (4 processes) against the same script on 2 processes without seqpar."""
    out = str(tmp_path_factory.mktemp("trl-rl-dp2"))
    results = run_distributed(_worker, 4, os.path.join(out, "seqpar"), CASES, 2, 2, timeout=900.0)
    plain = run_distributed(_worker, 2, os.path.join(out, "plain"), CASES, None, 2, timeout=900.0)
    return 4, results, plain[0]


def check(runs, case: str, loss_rtol: float = 0.0) -> None:
    world, results, refs = runs
    assert EXPECT[case.split("-")[0]] in refs[case]["metrics"], sorted(refs[case]["metrics"])
    p = world // (2 if world == 4 else 1)  # dp2 x sp2 runs on 4 ranks
    odd_peft = case.endswith("peft") and p & (p - 1)  # sp not a power of two, LoRA: see PEFT_GRAD_NORM_RTOL
    script.check_case(runs, case, loss_rtol=loss_rtol, start=refs[case]["start"],
                      grad_norm_rtol=PEFT_GRAD_NORM_RTOL if odd_peft else script.GRAD_NORM_RTOL)
    if case.split("-")[0] in ("grpo", "rloo"):  # the KL term is live: the policy is not its reference
        assert abs(refs[case]["metrics"]["kl"]) > 1e-3, refs[case]["metrics"]["kl"]
    if not case.endswith(("peft", "precomputed")):  # a reference model, run sharded on every rank
        assert all(res[case]["ref_parallelized"] for res in results) and not refs[case]["ref_parallelized"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_one_step_equals_the_script_without_seqpar(runs, case):
    check(runs, case)


@pytest.mark.distributed
@pytest.mark.heavy
@pytest.mark.parametrize("case", CASES)
def test_every_case_at_sp2_and_sp3(heavy_runs, case):
    check(heavy_runs, case)


@pytest.mark.distributed
@pytest.mark.heavy
@pytest.mark.parametrize("case", CASES)
def test_dp2_sp2_equals_the_script_on_two_processes(dp_runs, case):
    check(dp_runs, case, loss_rtol=2.0 ** -23)  # the plain script's float32 mean of two losses: test_trl_objectives


@pytest.mark.parametrize("option,value", [("sync_ref_model", True), ("use_vllm", True)])
def test_refuses_generation_options_by_name(option, value):
    from types import SimpleNamespace

    import seqpar
    from seqpar.integrations.trl.grpo import check_grpo_options

    args = SimpleNamespace(use_vllm=False, beta=0.1, use_liger_kernel=False, eval_strategy="no", sync_ref_model=False)
    check_grpo_options(SimpleNamespace(args=args, tools=None, rollout_func=None))  # beta 0.1 passes
    setattr(args, option, value)
    with pytest.raises(seqpar.Refused, match=option):
        check_grpo_options(SimpleNamespace(args=args, tools=None, rollout_func=None))


def test_refuses_kto_evaluation_by_name():
    from types import SimpleNamespace

    from trl import KTOTrainer

    import seqpar
    from seqpar.integrations.trl.mixins import check_trl_options

    trainer = object.__new__(KTOTrainer)
    trainer.args = SimpleNamespace(use_liger_kernel=False, eval_strategy="no")
    trainer.compute_loss_func, trainer.ref_model, trainer.precompute_ref_logps = None, object(), False
    trainer.model = torch.nn.Linear(1, 1)
    check_trl_options(trainer)  # the defaults pass
    trainer.args.eval_strategy = "steps"
    with pytest.raises(seqpar.Refused, match="evaluation"):
        check_trl_options(trainer)
