"""seqpar train end to end on 2 local gloo workers: a smoke run that learns the copy task, --resume
reproducing the uninterrupted loss curve exactly, and parity of the first step's loss and gradients
(float64) across sp=2, dp=2, gradient accumulation, ring attention, FSDP2 and a single process."""

import ctypes
import gc
import json
import os
import re

import pytest
import torch

from seqpar.comm.launch import run_distributed
from seqpar.train import TrainConfig
from seqpar.train.checkpoint import complete_checkpoints, load_model_weights, read_trainer_state
from seqpar.train.config import builtin_fields
from seqpar.train.demo_data import CopyTask
from seqpar.train.job import prepare_job
from seqpar.train.launcher import run_local
from seqpar.train.loop import _gather_stats, start_run

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes


def _metrics(save_dir):
    """The per-step lines of metrics.jsonl (the evaluations' lines, with "eval_loss", left out)."""
    with open(os.path.join(save_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "eval_loss" not in m]


# --------------------------------------------------------------------------------------------
# smoke + resume: 4 launches of 2 workers, shared by the tests below
# --------------------------------------------------------------------------------------------

OFF = dict(tiled_loss=False, tiled_mlp=False, checkpoint="none")  # every memory switch off


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    # the memory switches' per-call overhead dominates at 64 tokens: only the plain resume pair has them on
    smoke = TrainConfig(seq_len=64, micro_batch=8, lr=5e-3, warmup=5, steps=60, save_every=30, progress=False, seed=0,
                        save_dir=str(root / "smoke"), plot=False, **OFF)
    # the memory switches on (the defaults), with tiles small enough to cut these rows: resume stays exact
    resume = TrainConfig(seq_len=64, micro_batch=2, lr=5e-3, warmup=2, steps=8, save_every=4, progress=False,
                         eval_rows=2, loss_tile=24, mlp_tile=16, plot=False)
    out = {"smoke": run_local(prepare_job(smoke)), "smoke_cfg": smoke}
    # an earlier, different run in the same directory: the next run replaces it only with --overwrite
    out["earlier"] = run_local(prepare_job(resume.replace(save_dir=str(root / "straight"), steps=3, save_every=1,
                                                          keep_checkpoints=5, seq_len=16, **OFF)))
    with pytest.raises(ValueError) as refused:
        prepare_job(resume.replace(save_dir=str(root / "straight")))
    out["refused"] = str(refused.value)
    out["straight"] = run_local(prepare_job(resume.replace(save_dir=str(root / "straight"), overwrite=True)))
    part = resume.replace(save_dir=str(root / "parts"))
    out["first_half"] = run_local(prepare_job(part), stop_after=4)
    out["resumed"] = run_local(prepare_job(part.replace(resume=True)))
    # the same with FSDP2 (sharded checkpoints, float32 gradient reduction) and dp=2
    fsdp = resume.replace(fsdp="on", sp=1, nproc=2, steps=4, save_every=2, **OFF)
    run_local(prepare_job(fsdp.replace(save_dir=str(root / "fsdp_straight"))))
    run_local(prepare_job(fsdp.replace(save_dir=str(root / "fsdp_parts"))), stop_after=2)
    out["fsdp_resumed"] = run_local(prepare_job(fsdp.replace(save_dir=str(root / "fsdp_parts"), resume=True)))
    out["dirs"] = {k: str(root / k) for k in ("smoke", "straight", "parts", "fsdp_straight", "fsdp_parts")}
    return out


def test_smoke_loss_falls_and_task_beats_chance(runs):
    s = runs["smoke"]
    assert s.steps == 60 and len(s.losses) == 60
    assert s.last_loss < 0.75 * s.first_loss, (s.first_loss, s.last_loss)
    assert s.final_eval.accuracy > 5 * s.chance, s.final_eval
    assert s.first_eval.accuracy < 3 * s.chance  # before training: chance level
    assert len(s.peak_mem_mib) == 2 and min(s.peak_mem_mib) > 0


def test_metrics_one_line_per_step(runs):
    lines = _metrics(runs["dirs"]["smoke"])
    assert [m["step"] for m in lines] == list(range(1, 61))
    for m in lines:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_mem_mib", "peak_reserved_mib"} <= set(m)
        assert len(m["peak_mem_mib"]) == 2 and m["peak_reserved_mib"] == m["peak_mem_mib"]  # the CPU: both RSS
    assert [m["loss"] for m in lines] == [loss for _, loss in runs["smoke"].losses]
    with open(os.path.join(runs["dirs"]["smoke"], "metrics.jsonl")) as f:
        evals = [m for m in map(json.loads, f) if "eval_loss" in m]  # before training, every 20 steps (the default)
    s = runs["smoke"]
    assert [st for st, _ in s.evals] == [20, 40, 60] and s.evals[-1][1] == s.final_eval
    assert [(m["step"], m["eval_loss"], m["eval_accuracy"]) for m in evals] == [
        (0, s.first_eval.loss, s.first_eval.accuracy), *((st, e.loss, e.accuracy) for st, e in s.evals)]


def test_checkpoints_written_and_loadable(runs):
    found = complete_checkpoints(runs["dirs"]["smoke"])
    assert [step for step, _ in found] == [30, 60]
    assert runs["smoke"].checkpoint == os.path.abspath(found[-1][1])
    state = read_trainer_state(found[-1][1])
    assert state["step"] == 60 and state["sp"] == 2 and state["config"]["seq_len"] == 64
    # a single process, no process group: the weights load into a fresh model
    from seqpar.integrations.models import build_model

    cfg = runs["smoke_cfg"]
    model, _ = build_model(cfg.model, **builtin_fields(cfg, CopyTask(64).vocab_size))
    before = model.model.embed_tokens.weight.clone()
    load_model_weights(found[-1][1], model)
    assert not torch.equal(before, model.model.embed_tokens.weight)
    assert not os.listdir(os.path.join(runs["dirs"]["smoke"], "checkpoints")) == []
    assert not [n for n in os.listdir(os.path.join(runs["dirs"]["smoke"], "checkpoints")) if n.startswith(".tmp")]


@pytest.mark.parametrize("kind", ["", "fsdp_"])
def test_resume_continues_the_same_loss_curve_exactly(runs, kind):
    straight = _metrics(runs["dirs"][kind + "straight"])
    parts = _metrics(runs["dirs"][kind + "parts"])
    n = 4 if kind else 8
    assert runs[kind + "resumed"].resumed_from.endswith(f"step_{n // 2:08d}")
    assert runs[kind + "resumed"].fsdp == bool(kind)
    if not kind:
        assert runs["resumed"].memory == "tiled loss (24 tokens), tiled MLP (16 tokens), checkpoint layers"
    assert [m["step"] for m in parts] == list(range(1, n + 1))
    for a, b in zip(straight, parts, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["lr"] == b["lr"], (a, b)
    if not kind:
        assert runs["straight"].final_eval == runs["resumed"].final_eval


def test_second_run_replaces_the_first_only_with_overwrite(runs):
    """A fresh run into a save dir that holds an earlier run's checkpoints is refused before any worker
    starts (the message names --resume and --overwrite); with --overwrite it starts over there."""
    assert "holds 3 checkpoints of an earlier run (the latest at step 3)" in runs["refused"]
    assert "--resume continues it, --overwrite deletes them" in runs["refused"]
    assert runs["earlier"].steps == 3 and runs["straight"].replaced_previous
    assert runs["straight"].replaced_steps == [1, 2, 3]
    assert [s for s, _ in complete_checkpoints(runs["dirs"]["straight"])] == [4, 8]
    assert [m["step"] for m in _metrics(runs["dirs"]["straight"])] == list(range(1, 9))


# --------------------------------------------------------------------------------------------
# parity of the first step (float64): one launch of 2 workers, one of 1
# --------------------------------------------------------------------------------------------

DOCS = ["a" * 3, "the quick brown fox", "jumps over the lazy dog " * 3, "x", "seqpar " * 9, "abc def ghi jkl",
        "0123456789" * 4, "hello world", "tokens weighted by count", "z" * 40, "short", "mid length document",
        "held out from training " * 4]  # 10+ rows: one is held out for the evaluation


def _data_file(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in DOCS) + "\n")
    return str(path)


def _vm_hwm_mib():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


def _sharded_setup(cfg, world):
    """Peak RSS growth (MiB) while this rank builds the Trainer, then whether its weights equal the
    unsharded ones exactly: transformers' own init (to_empty + seed + initialize_weights) of the whole
    model for a built-in, the checkpoint's tensors for a path."""
    from transformers import AutoModelForCausalLM

    from seqpar.integrations.models import build_model

    job = prepare_job(cfg, world)
    with torch.device("meta"):  # transformers' model classes imported and warm: not part of the measure
        AutoModelForCausalLM.from_config(build_model("small-llama3")[0].config)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # an earlier case's freed memory back to the OS: not reused here
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _vm_hwm_mib()
    trainer = start_run(job)
    grown = _vm_hwm_mib() - before
    if cfg.model == "small-llama3":
        with torch.device("meta"):
            ref, _ = build_model(cfg.model, **builtin_fields(cfg, trainer.data.vocab_size))
        ref.to_empty(device="cpu")
        for m in ref.modules():
            m._is_hf_initialized = False
        torch.manual_seed(cfg.seed)
        ref.initialize_weights()
        expected = dict(ref.named_parameters())
    else:
        from safetensors.torch import load_file

        expected = load_file(os.path.join(cfg.model, "model.safetensors"))
    got = {n.replace("_fsdp_wrapped_module.", ""): p.full_tensor() for n, p in trainer.model.named_parameters()}
    same = set(got) == set(expected) and all(torch.equal(got[n], expected[n]) for n in got)
    full_mib = sum(t.numel() * 4 for t in got.values()) / 2**20
    return {"grown": grown, "full": full_mib, "same": same, "fsdp": trainer.ctx.use_fsdp}


def _sharded_setups(rank, world, cfgs):
    return [_sharded_setup(cfg, world) for cfg in cfgs]


def _first_step(rank, world, cfgs):
    out = []
    for cfg in cfgs:
        trainer = start_run(prepare_job(cfg, world))
        share, n = trainer.steps.forward_backward(0)
        loss, _, _ = _gather_stats(trainer.ctx, share)
        grads = {}
        for name, p in trainer.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.replace("_fsdp_wrapped_module.", "")] = g.detach().clone()
        params = {name.replace("_fsdp_wrapped_module.", ""): p.full_tensor() if hasattr(p, "full_tensor") else p
                  for name, p in trainer.model.named_parameters()}
        out.append({"loss": loss, "targets": n, "grads": grads, "params": {k: v.detach().clone()
                                                                          for k, v in params.items()},
                    "eval": trainer.evaluate()})  # with tiled_loss: from token_stats, no full logits
    return out


PARITY = {  # name: (world, options); every one reads rows 0 and 1 of the same packed data
    "sp2_mb2": (2, dict(sp=2, micro_batch=2)),
    "sp2_plain": (2, dict(sp=2, micro_batch=2, tiled_loss=False, tiled_mlp=False, checkpoint="none")),
    "dp2": (2, dict(sp=1, micro_batch=1)),
    "sp2_accum2": (2, dict(sp=2, micro_batch=1, grad_accum=2)),
    "sp2_ring": (2, dict(sp=2, micro_batch=2, strategy="ring")),
    "sp2_fsdp": (2, dict(sp=2, micro_batch=2, fsdp="on")),
    "sp2_fsdp_accum2": (2, dict(sp=2, micro_batch=1, grad_accum=2, fsdp="on")),  # one reduce-scatter per step
    "sp4_hybrid": (4, dict(sp=4, micro_batch=2, strategy="hybrid")),
    "sp2_dp2_fsdp": (4, dict(sp=2, micro_batch=1, fsdp="on")),
}


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    # every case with the memory switches on, in several tiles; the reference without any (plain model)
    base = TrainConfig(data=[_data_file(tmp)], packing=True, seq_len=37, dtype="float64", progress=False,
                       loss_tile=7, mlp_tile=5,
                       save_dir=str(tmp / "unused"), model_config=json.dumps({"hidden_size": 32, "head_dim": 8,
                                                                              "intermediate_size": 64,
                                                                              "vocab_size": 300}))
    results = {}
    for world in (2, 4):
        names = [n for n, (w, _) in PARITY.items() if w == world]
        got = run_distributed(_first_step, world, [base.replace(**PARITY[n][1]) for n in names], timeout=300)[0]
        results.update(zip(names, got, strict=True))
    plain = base.replace(sp=1, micro_batch=2, tiled_loss=False, tiled_mlp=False, checkpoint="none")
    ref = run_distributed(_first_step, 1, [plain], timeout=300)[0][0]
    return ref, results


# small-llama3 widened to 49M parameters (188 MiB in fp32): its lm_head, the largest module, is 9% of it
WIDE = {"hidden_size": 512, "intermediate_size": 1792, "num_hidden_layers": 12, "head_dim": 64}


def _wide_setups(tmp):
    """Sharded init of a built-in and sharded loading of a checkpoint (FSDP2)."""
    from seqpar.integrations.models import build_model

    path = tmp / "wide"
    model, _ = build_model("small-llama3", max_position_embeddings=64, **WIDE)
    model.save_pretrained(path)
    del model
    wide = TrainConfig(model="small-llama3", model_config=json.dumps(WIDE), seq_len=64, fsdp="on", progress=False,
                       save_dir=str(tmp / "unused"), seed=7)
    return [wide, wide.replace(model=str(path), model_config="")]


@pytest.mark.heavy  # 4 ranks building a 188 MiB model twice: about 30 s on an idle 2-core machine
def test_sharded_init_and_loading_keep_ranks_under_the_model_size(tmp_path):
    """No rank > 0 ever holds the whole model (FSDP2 over 4 ranks): its peak RSS grows by its quarter
    of the weights plus one module's temporaries -- the trainer used to build the whole fp32 model on
    every rank before sharding (>= 1.25x) -- and every rank's weights are exactly the unsharded
    init's / the checkpoint's."""
    per_rank = run_distributed(_sharded_setups, 4, _wide_setups(tmp_path), timeout=900)
    for case in (0, 1):  # a built-in's init, a checkpoint read by rank 0
        for rank in range(4):
            r = per_rank[rank][case]
            assert r["fsdp"] and r["same"], (case, rank, r)
            assert r["full"] > 180, r
            if rank > 0:
                assert r["grown"] < 0.6 * r["full"], (case, rank, r)  # measured 0.39-0.50 (1/4 + temporaries)


@pytest.mark.parametrize("name", list(PARITY))
def test_first_step_matches_single_process(parity, name):
    ref, results = parity
    got = results[name]
    assert got["targets"] == ref["targets"] > 0
    assert abs(got["loss"] - ref["loss"]) <= 1e-9, (got["loss"], ref["loss"])
    assert set(got["grads"]) == set(ref["grads"])
    assert all(torch.equal(got["params"][k], ref["params"][k]) for k in ref["params"])  # the same init bits
    worst = max(float((got["grads"][k] - ref["grads"][k]).abs().max()) for k in ref["grads"])
    assert worst <= 1e-8, worst
    assert ref["eval"].targets > 0 and got["eval"].targets == ref["eval"].targets
    assert abs(got["eval"].loss - ref["eval"].loss) <= 1e-9 and got["eval"].accuracy == ref["eval"].accuracy
    assert max(float(g.abs().max()) for g in ref["grads"].values()) > 1e-3  # not trivially zero
