"""A dynamic SP schedule inside transformers' Trainer (``parallelize_trainer(trainer, mesh,
schedule=DynamicSP(...))``): two optimizer steps (grad accumulation 2, padded rows of 9..30 tokens,
bins at degrees 1 and 2) on 2 gloo ranks (dp=2 x sp=2 on 4: ``-m heavy``) equal the Trainer without
seqpar on one process, float64: every logged loss (1e-9) and every weight after plain SGD at
learning rate 1 (so a weight's change is its gradient: 1e-8) -- under the Trainer's DDP and under
accelerate's FSDP2 (``fsdp_config={"version": 2}``; accelerate picks DDP on a CPU, so the test sets
its state as on GPUs: :func:`_fsdp_as_on_gpus`). Bad use is refused by name (FSDP1, DeepSpeed)."""

from __future__ import annotations

import os

import pytest
import torch
from trainer_rows import VOCAB, collate, rows

from seqpar.comm.launch import run_distributed

BUDGET = 16  # tokens per rank per bin: rows of <= 16 tokens on one rank, longer ones on both
LOSS_TOL, WEIGHT_TOL = 1e-9, 1e-8


def _fsdp_as_on_gpus(trainer) -> None:
    """accelerate runs DDP on a CPU even when FSDP is configured (its state keeps MULTI_CPU and no
    plugin); give it the state it has on GPUs -- the plugin the arguments describe, FSDP as the
    distributed type, the Trainer's flag -- so that train() shards the model with accelerate's own
    fsdp2_prepare_model and runs its FSDP code paths (no_sync, clipping, the optimizer's DTensors)."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def _args(out: str, fsdp: int | None = None, **kw):
    from transformers import TrainingArguments

    # FSDP1 syncs module states by default, which it refuses on a CPU
    on = {} if fsdp is None else dict(fsdp=True, fsdp_config={"version": fsdp, "sync_module_states": fsdp == 2})
    return TrainingArguments(output_dir=out, use_cpu=True, report_to=[], **on, **kw)


def train(out: str, mesh=None, fsdp: bool = False) -> dict:
    """The user's script; with ``mesh`` the two seqpar lines (a schedule, parallelize_trainer);
    ``fsdp``: under accelerate's FSDP2."""
    from transformers import Trainer

    from seqpar.integrations.models import build_model

    torch.manual_seed(0)
    net, _ = build_model("tiny-llama", dtype=torch.float64, vocab_size=VOCAB)
    args = _args(out, 2 if fsdp else None, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                 max_steps=2, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
                 weight_decay=0.0, logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True)
    trainer = Trainer(model=net, args=args, train_dataset=rows(32, 1), data_collator=collate)
    if fsdp:
        _fsdp_as_on_gpus(trainer)
    if mesh is not None:
        from seqpar.integrations.trainer.mixin import parallelize_trainer
        from seqpar.planner.bins import DynamicSP

        def cost(docs, k):  # a sub-group only for rows that do not fit one rank
            return sum(docs) / k + (50.0 if k > 1 else 0.0)

        parallelize_trainer(trainer, mesh, schedule=DynamicSP(mesh, token_budget=BUDGET, cost=cost))
    trainer.train()
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in net.named_parameters()}  # FSDP2
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "weights": {n: p.detach().clone() for n, p in full.items()},
            "degrees": dict(getattr(trainer, "rows_at_degree", {}))}


def _bad(mesh, out: str) -> dict:
    from transformers import Trainer

    from seqpar.integrations.models import build_model
    from seqpar.integrations.trainer.mixin import parallelize_trainer
    from seqpar.planner.bins import DynamicSP

    seen = {}
    for name, kw in [("sp", dict(sp=2)), ("layout", dict(layout="zigzag")), ("fsdp1", {}), ("deepspeed", {})]:
        net, _ = build_model("tiny-llama", dtype=torch.float64, vocab_size=VOCAB)
        trainer = Trainer(model=net, args=_args(out, 1 if name == "fsdp1" else None),
                          train_dataset=rows(4, 1), data_collator=collate)
        if name == "fsdp1":
            _fsdp_as_on_gpus(trainer)
        trainer.is_deepspeed_enabled = name == "deepspeed"  # the Trainer's flag (deepspeed is not installed)
        try:
            dyn = DynamicSP(mesh, token_budget=BUDGET, cost=lambda d, k: float(sum(d)))
            parallelize_trainer(trainer, None if name == "sp" else mesh, schedule=dyn, **kw)
            seen[name] = None
        except ValueError as e:
            seen[name] = str(e)
    return seen


def _worker(rank: int, world: int, out: str) -> dict:
    torch.set_num_threads(1)
    import seqpar

    mesh = seqpar.init_mesh(sp=2, device_type="cpu")  # dp = world / 2
    return {"run": train(os.path.join(out, "dyn"), mesh), "fsdp": train(os.path.join(out, "fsdp"), mesh, fsdp=True),
            "bad": _bad(mesh, os.path.join(out, "bad"))}


# dp=2 x sp=2 is heavy: four processes importing the Trainer do not fit the default budget on 2 cores
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.heavy)], ids=["sp2", "dp2xsp2"])
def runs(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trainer-dyn"))
    return run_distributed(_worker, request.param, out, timeout=600.0), train(os.path.join(out, "ref"))


@pytest.mark.distributed
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_a_dynamic_step_equals_the_trainer_without_seqpar(runs, wrapper):
    results, ref = runs
    assert len(ref["losses"]) == 2
    for rank, res in enumerate(results):
        run = res["run" if wrapper == "ddp" else "fsdp"]
        assert set(run["degrees"]) == {1, 2} and sum(run["degrees"].values()) == 2 * 2 * 4, run["degrees"]
        for step, (a, b) in enumerate(zip(run["losses"], ref["losses"], strict=True)):
            assert abs(a - b) <= LOSS_TOL, f"rank {rank} step {step + 1}: loss {a!r} vs {b!r}"
        for name, w in ref["weights"].items():
            err = float((run["weights"][name] - w).abs().max())
            assert err <= WEIGHT_TOL, f"rank {rank}: {name} off by {err:.3g}"


@pytest.mark.distributed
def test_bad_use_is_refused_by_name(runs):
    results, _ = runs
    for res in results:
        assert "takes the mesh the schedule was built over" in res["bad"]["sp"]
        assert "layout='zigzag' differs from the schedule's 'contiguous'" in res["bad"]["layout"]
        assert "FSDP1's (fsdp_config version=1)" in res["bad"]["fsdp1"], res["bad"]["fsdp1"]
        assert "DeepSpeed's (TrainingArguments.deepspeed)" in res["bad"]["deepspeed"], res["bad"]["deepspeed"]
