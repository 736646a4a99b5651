"""seqpar train on the N-D mesh: --tp and --ep, checkpoints that resume at another layout, export
from any layout, --plan auto (issue 46).

    make test    (4 gloo ranks, one start; and one single process) float64: --tp 2 --sp 2 trains to the
                 losses, gradient norms and held-out loss of --sp 4 and of --sp 1 on one process (and
                 under FSDP2: 2-D DTensors); a
                 checkpoint written at --tp 2 --sp 2 resumes at --sp 4 and at --sp 2 (dp 2, the same rows
                 per step) to the uninterrupted run's losses; --ep 2 (tiny-qwen3-moe) trains to --ep 1's
                 losses and resumes exactly; the refusals by name (pure).
    make verify  (heavy) the same in float32 (to rounding), tp with dp 2, FSDP2 resumed without it; --objective
                 dpo (its reference a copy of the TP model), reward (a score head) and kto at tp2 x sp2
                 against sp4 (the objectives' vocabulary-parallel log-probs); an --ep 2
                 checkpoint resumed at --ep 1 and an --ep 1 one at --ep 2; seqpar export of a tp and an
                 ep checkpoint (whole experts, the same weights as the other layouts'); --plan auto runs
                 and chooses what seqpar plan prints for the same inputs.
"""

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from seqpar.comm.launch import run_distributed
from seqpar.train import TrainConfig
from seqpar.train.job import prepare_job
from seqpar.train.loop import run_training

SMALL = json.dumps({"hidden_size": 32, "head_dim": 8, "intermediate_size": 64})
BASE = TrainConfig(seq_len=32, steps=4, micro_batch=2, dtype="float64", progress=False, plot=False, eval_rows=2,
                   eval_every=0, lr=5e-3, warmup=1, save_every=2, loss_tile=7, mlp_tile=5, model_config=SMALL)
MOE = BASE.replace(model="tiny-qwen3-moe", micro_batch=1, tiled_mlp=False, mlp_tile=None)


def _metrics(save_dir):
    with open(os.path.join(save_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "eval_loss" not in m]


def _train(rank, world, jobs):
    """Each job ``(name, cfg, stop_after, resume_from_dir)`` in turn on these ranks: a resumed job
    first gets a copy of the other run's save dir (its checkpoints up to ``stop_after`` of that run)."""
    out = {}
    for name, cfg, stop, source in jobs:
        if source is not None:
            if rank == 0:
                shutil.copytree(source, cfg.save_dir)
            dist.barrier()
        s = run_training(prepare_job(cfg, world), stop_after=stop)
        out[name] = {"losses": [loss for _, loss in s.losses], "eval": s.final_eval, "resumed": s.resumed_step,
                     "norms": [m["grad_norm"] for m in _metrics(cfg.save_dir)] if rank == 0 else None}
    return out


def _jobs(root, base, cases):
    """``cases``: (name, options, stop_after, resume from the run named) -> _train's jobs."""
    jobs = []
    for name, kw, stop, source in cases:
        cfg = base.replace(save_dir=str(root / name), **kw)
        if source is not None:
            cfg = cfg.replace(resume=True)
        jobs.append((name, cfg, stop, None if source is None else str(root / source)))
    return jobs


FAST = [("tp2sp2", dict(tp=2, sp=2), None, None),
        ("sp4", dict(sp=4), None, None),
        ("tp2sp2_fsdp", dict(tp=2, sp=2, fsdp="on"), None, None),  # FSDP2's 2-D (_StridedShard, Shard) DTensors
        ("tp2sp2_part", dict(tp=2, sp=2), 2, None),
        ("at_sp4", dict(sp=4), None, "tp2sp2_part"),
        ("at_sp2dp2", dict(sp=2, micro_batch=1), None, "tp2sp2_part")]  # dp 2 x 1 row: the same 2 rows a step
FAST_MOE = [("ep2", dict(sp=2, ep=2), None, None),
            ("ep1", dict(sp=2), None, None),
            ("ep2_part", dict(sp=2, ep=2), 2, None),
            ("ep2_resumed", dict(sp=2, ep=2), None, "ep2_part")]


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    root = tmp_path_factory.mktemp("nd")
    jobs = _jobs(root, BASE, FAST) + _jobs(root, MOE, FAST_MOE)
    out = run_distributed(_train, 4, jobs, timeout=900)[0]
    out["sp1"] = run_distributed(_train, 1, _jobs(root, BASE, [("sp1", dict(sp=1), None, None)]), timeout=300)[0]["sp1"]
    return out


def _close(a, b, rel):
    assert len(a) == len(b) and a, (a, b)
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= rel * max(abs(y), 1.0), (a, b)


@pytest.mark.distributed
@pytest.mark.parametrize("name, other", [("tp2sp2", "sp4"), ("tp2sp2", "sp1"), ("tp2sp2_fsdp", "sp4")])
def test_tp2_sp2_trains_to_the_losses_of_sp4_and_of_one_process(fast, name, other):
    """float64: the same rows, the same losses step by step (the loss counted once per dp group, not
    per tp rank), the same clipped gradient norms (tp shards summed over tp; under FSDP2 over dp x sp
    too), the same held-out loss."""
    tp, ref = fast[name], fast[other]
    _close(tp["losses"], ref["losses"], 1e-12)
    _close(tp["norms"], ref["norms"], 1e-10)
    assert tp["losses"][-1] < tp["losses"][0]  # it trains
    assert abs(tp["eval"].loss - ref["eval"].loss) <= 1e-12 and tp["eval"].targets == ref["eval"].targets > 0
    assert tp["eval"].accuracy == ref["eval"].accuracy


@pytest.mark.distributed
@pytest.mark.parametrize("resumed", ["at_sp4", "at_sp2dp2"])
def test_a_tp2_sp2_checkpoint_resumes_at_another_layout(fast, resumed):
    got, straight = fast[resumed], fast["tp2sp2"]
    assert got["resumed"] == 2 and fast["tp2sp2_part"]["losses"] == straight["losses"][:2]
    _close(got["losses"], straight["losses"][2:], 1e-12)
    _close(got["norms"][2:], straight["norms"][2:], 1e-10)  # metrics.jsonl: the first two lines came with it
    assert abs(got["eval"].loss - straight["eval"].loss) <= 1e-12


@pytest.mark.distributed
def test_ep2_trains_to_ep1_and_resumes_exactly(fast):
    ep2, ep1 = fast["ep2"], fast["ep1"]
    _close(ep2["losses"], ep1["losses"], 1e-12)
    _close(ep2["norms"], ep1["norms"], 1e-10)  # expert shards' squares summed over the ep ranks
    resumed = fast["ep2_resumed"]
    assert resumed["resumed"] == 2
    assert resumed["losses"] == ep2["losses"][2:] and resumed["eval"] == ep2["eval"]  # the same layout: bit-exact


# ---------------------------------------------------------------------------------------------
# pure: the options refused by name, before any worker starts
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, needle", [
    (dict(tp=3, sp=2, nproc=4), "--sp 2 x --tp 3 = 6 does not divide the world size 4"),
    (dict(tp=0), "--tp must be >= 1"),
    (dict(tp=2, sp=1, ep=2, nproc=4, model="tiny-qwen3-moe"),
     "--tp 2 with --ep 2: seqpar.parallelize does not compose"),
    (dict(ep=3, sp=2, nproc=4), "--ep 3 must divide dp x sp = 2 x 2 = 4"),
    (dict(ep=2, sp=2, nproc=4, fsdp="on"), "--ep 2 shards the experts over ep ranks, which FSDP2"),
    (dict(ep=2, sp=2, nproc=4, dtype="bfloat16"), "--dtype bfloat16 trains through FSDP2's mixed precision, which"),
    (dict(tp=2, sp=2, sp_schedule="dynamic"), "--sp-schedule dynamic with --tp 2"),
    (dict(tp=2, sp=1, lora_r=4), "--lora-r with --tp 2"),
    (dict(tp=2, sp=2, model_config=json.dumps({"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3,
                                               "head_dim": 16})),
     "--tp 2: LlamaForCausalLM has 3 query and 3 KV heads, which tp=2 cannot split"),
    (dict(ep=2, sp=2, nproc=4), "--ep 2: LlamaForCausalLM declares no expert-parallel plan"),
    (dict(ep=4, sp=4, model="tiny-qwen3-moe", tiled_mlp=False, model_config=json.dumps({"num_experts": 6})),
     "6 experts over 4 ranks are split [2, 2, 1, 1] (torch.tensor_split"),
    (dict(sp=2, model="tiny-qwen3-moe"), "--tiled-mlp tiles per-token MLPs, not the MoE blocks"),
    (dict(plan="auto", tp=2), "--plan auto chooses --tp itself"),
    (dict(plan="auto"), "--plan auto plans for the ranks the job has: give --nproc N"),
    (dict(gpu_memory="80GB"), "--gpu-memory is the memory --plan auto plans against"),
    (dict(plan="auto", nproc=4, gpu_memory="lots"), "'lots' is not a size"),
])
def test_what_cannot_run_is_refused_by_name(options, needle, tmp_path):
    with pytest.raises(ValueError) as e:
        prepare_job(TrainConfig(seq_len=32, save_dir=str(tmp_path), **options))
    assert needle in str(e.value), str(e.value)


def test_the_options_from_the_command_line_and_config_files(tmp_path):
    import argparse

    from seqpar.cli.train import add_parser, config_from_args
    from seqpar.train.config import load_config_file

    (tmp_path / "a.yaml").write_text("tp: 2\nsp: 2\nep: 1\nplan: none\n")
    (tmp_path / "b.toml").write_text('ep = 2\nplan = "auto"\ngpu-memory = "80GB"\n')
    assert load_config_file(str(tmp_path / "a.yaml")) == {"tp": 2, "sp": 2, "ep": 1, "plan": "none"}
    assert load_config_file(str(tmp_path / "b.toml")) == {"ep": 2, "plan": "auto", "gpu_memory": "80GB"}
    with pytest.raises(ValueError, match="tp = '2' should be int"):
        (tmp_path / "c.yaml").write_text("tp: '2'\n")
        load_config_file(str(tmp_path / "c.yaml"))
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--config", str(tmp_path / "a.yaml"), "--tp", "4", "--ep", "2"])
    cfg = config_from_args(args)
    assert (cfg.tp, cfg.sp, cfg.ep, cfg.plan) == (4, 2, 2, "none")  # the command line wins
    auto = config_from_args(parser.parse_args(["train", "--plan", "auto", "--gpu-memory", "80GB"]))
    assert (auto.plan, auto.gpu_memory) == ("auto", "80GB")


def test_the_dcp_split_of_the_experts():
    from seqpar.train.expert_state import checkpoint_split_problem

    assert checkpoint_split_problem(4, 2) is None and checkpoint_split_problem(5, 2) is None  # 3 + 2 both ways
    assert checkpoint_split_problem(8, 4) is None
    assert "[3, 2, 2]" in checkpoint_split_problem(7, 3) and "[3, 3, 1]" in checkpoint_split_problem(7, 3)


def test_the_layout_is_said_and_resumes_note_tp_and_ep(tmp_path):
    from seqpar.cli.train import describe_start
    from seqpar.train.job import check_resumable

    job = prepare_job(BASE.replace(tp=2, sp=2, save_dir=str(tmp_path)))
    assert (job.world, job.sp, job.dp, job.tp, job.batch_ranks) == (4, 2, 1, 2, 4)
    assert job.mesh_kwargs == {"dp_shard": 1, "sp": 2, "tp": 2}
    assert "tp=2 x sp=2 x dp=1" in describe_start(job)
    state = {"config": BASE.to_dict(), "dp": 1, "sp": 2, "tp": 2, "ep": 1, "step": 2}
    (note,) = check_resumable(prepare_job(BASE.replace(sp=4, save_dir=str(tmp_path))), state, "ckpt")
    assert "sp 2 -> 4, tp 2 -> 1" in note and "DCP reshards" in note
    moe = prepare_job(MOE.replace(sp=2, ep=2, nproc=4, save_dir=str(tmp_path)))
    assert moe.mesh_kwargs == {"dp_shard": 2, "sp": 2, "tp": 1, "ep": 2} and "sp=2 x dp=2, ep=2" in describe_start(moe)


@pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_clipping_scales_dtensor_and_plain_gradients_alike():
    """The update's clip multiplies each gradient's local part (a DTensor's through to_local: one
    storage), which torch's foreach clip refuses for a mix of DTensor and plain gradients."""
    from seqpar.train.step import Optimization

    model = torch.nn.Linear(3, 2)
    opt = Optimization(BASE.replace(grad_clip=0.5, lr=0.0), model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 2.0)
    norm = opt.grad_norm()
    assert abs(norm[1] - 2.0 * 8 ** 0.5) < 1e-6
    opt.optimizer.step = lambda: None  # only the clipping
    grads = []
    opt.optimizer.zero_grad = lambda set_to_none=True: grads.extend(p.grad.clone() for p in model.parameters())
    opt.apply(norm)
    total = torch.cat([g.flatten() for g in grads]).norm()
    assert abs(float(total) - 0.5) < 1e-5


# ---------------------------------------------------------------------------------------------
# --plan auto: the layout seqpar plan prints for the same inputs (pure), and it runs (heavy)
# ---------------------------------------------------------------------------------------------

PLANS = {"llama": BASE.replace(seq_len=64, dtype="float32", plan="auto", nproc=4, gpu_memory="64MB"),
         "moe": MOE.replace(seq_len=64, dtype="float32", plan="auto", nproc=4, gpu_memory="600KB", tiled_mlp=True)}


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_auto_takes_what_seqpar_plan_prints(name, tmp_path, capsys):
    from seqpar.cli.main import main
    from seqpar.integrations.models import builtin_config
    from seqpar.train.config import builtin_fields

    cfg = PLANS[name].replace(save_dir=str(tmp_path / "run"))
    job = prepare_job(cfg)
    builtin_config(cfg.model, **builtin_fields(cfg, job.data.vocab_size)).save_pretrained(tmp_path / "model")
    assert main(["plan", "--model", str(tmp_path / "model"), "--gpus", "4", "--gpus-per-node", "4", "--gpu-memory",
                 cfg.gpu_memory, "--seq-len", str(cfg.seq_len), "--dtype", "fp32", *(["--moe"] if name == "moe" else [])
                 ]) == 0
    chosen = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("chosen: "))
    label, switches = chosen[len("chosen: "):].split("; memory switches: ")
    assert job.plan_reason.startswith(f"--plan auto: {label}, memory switches {switches}, "), (chosen, job.plan_reason)
    c = job.cfg  # the options it runs with are the plan's
    assert f"sp={c.sp} tp={c.tp}" in label and (f"ep={c.ep}" in label) == (c.ep > 1) and f"({c.strategy})" in label
    assert (c.tp, c.sp, c.ep) == ((2, 2, 1) if name == "llama" else (1, 4, 4)), label  # what this case exercises
    assert c.fsdp == ("on" if c.ep == 1 else "off") and job.mesh_kwargs.get("tp", 1) == c.tp


def test_plan_auto_maps_a_large_plan_onto_the_options():
    """A 8B-like shape on 16 GPUs of 80 GB at 128k tokens: the options and the mesh are the plan's."""
    from transformers import LlamaConfig

    from seqpar.train.layout import auto_layout

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    cfg = TrainConfig(plan="auto", seq_len=131072, dtype="bfloat16", gpu_memory="80GB")
    planned, kwargs, words, p = auto_layout(cfg, 16, config, device_type="cuda", local_ranks=8)
    c = p.chosen
    assert (planned.sp, planned.tp, planned.ep, planned.dp) == (c.sp, c.tp, c.ep, c.dp_replicate * c.dp_shard)
    assert (planned.tiled_loss, planned.tiled_mlp, planned.checkpoint) == (c.switches.tiled_loss, c.switches.tiled_mlp,
                                                                          c.switches.checkpoint)
    assert planned.strategy == c.strategy and c.label in words and p.reason in words
    assert kwargs == (c.mesh_kwargs() if c.dp_replicate > 1 or c.tp > 1 or c.ep > 1 else kwargs)
    assert c.sp * c.tp * c.dp_replicate * c.dp_shard == 16


# ---------------------------------------------------------------------------------------------
# heavy: float32, FSDP2, tp with dp, ep across layouts, tp on an MoE, export, --plan auto's runs
# ---------------------------------------------------------------------------------------------

HEAVY = [("tp2sp2", dict(tp=2, sp=2, export_hf=True), None, None),
         ("sp4", dict(sp=4, export_hf=True), None, None),
         ("tp2dp2", dict(tp=2, sp=1, micro_batch=1), None, None),  # a tp group per dp rank: its own rows
         ("tp2sp2_fsdp", dict(tp=2, sp=2, fsdp="on"), None, None),
         ("tp2sp2_fsdp_part", dict(tp=2, sp=2, fsdp="on"), 2, None),
         ("fsdp_at_sp4", dict(sp=4), None, "tp2sp2_fsdp_part"),
         ("tp2sp2_f32", dict(tp=2, sp=2, dtype="float32"), None, None),
         ("sp4_f32", dict(sp=4, dtype="float32"), None, None)]
HEAVY_MOE = [("ep2", dict(sp=2, ep=2), None, None),
             ("ep1", dict(sp=2), None, None),
             ("ep2_part", dict(sp=2, ep=2), 2, None),
             ("ep2_at_ep1", dict(sp=2), None, "ep2_part"),
             ("ep2_at_ep4", dict(sp=4, ep=4, micro_batch=2), None, "ep2_part"),
             ("ep1_part", dict(sp=2), 2, None),
             ("ep1_at_ep2", dict(sp=2, ep=2), None, "ep1_part"),
             ("moe_tp2", dict(tp=2, sp=2, micro_batch=2), None, None)]  # the experts whole on each tp rank


OBJECTIVES_AT_TP = ("dpo", "reward", "kto")  # the embedded demos: a reference copy under TP, a score head, KL rows
HEAVY_OBJ = [(f"{o}_{name}", dict(objective=o, **kw), None, None) for o in OBJECTIVES_AT_TP
             for name, kw in (("tp2sp2", dict(tp=2, sp=2)), ("sp4", dict(sp=4)))]


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    root = tmp_path_factory.mktemp("nd_heavy")
    plans = [(f"plan_{n}", cfg.replace(save_dir=str(root / f"plan_{n}")), None, None) for n, cfg in PLANS.items()]
    jobs = (_jobs(root, BASE, HEAVY) + _jobs(root, MOE, HEAVY_MOE) + plans
            + _jobs(root, BASE.replace(seq_len=64, save_every=0), HEAVY_OBJ))
    out = run_distributed(_train, 4, jobs, timeout=1800)[0]
    return root, out


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("name, ref, rel", [("tp2sp2_f32", "sp4_f32", 1e-5), ("tp2dp2", "sp4", 1e-12),
                                            ("ep2", "ep1", 1e-12),
                                            ("moe_tp2", "ep1", 1e-12),
                                            *((f"{o}_tp2sp2", f"{o}_sp4", 1e-12) for o in OBJECTIVES_AT_TP)])
def test_heavy_layouts_train_to_the_same_losses(heavy, name, ref, rel):
    _, out = heavy
    _close(out[name]["losses"], out[ref]["losses"], rel)
    _close(out[name]["norms"], out[ref]["norms"], 100 * rel)
    assert abs(out[name]["eval"].loss - out[ref]["eval"].loss) <= rel * out[ref]["eval"].loss


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("resumed, straight", [("fsdp_at_sp4", "tp2sp2_fsdp"), ("ep2_at_ep1", "ep2"),
                                               ("ep2_at_ep4", "ep2"), ("ep1_at_ep2", "ep1")])
def test_heavy_checkpoints_resume_at_another_layout(heavy, resumed, straight):
    _, out = heavy
    assert out[resumed]["resumed"] == 2
    _close(out[resumed]["losses"], out[straight]["losses"][2:], 1e-12)
    assert abs(out[resumed]["eval"].loss - out[straight]["eval"].loss) <= 1e-12


def _exported(root, name, tmp_path, capsys, tag=""):
    from safetensors.torch import load_file

    from seqpar.cli.main import main

    out = tmp_path / f"export_{name}{tag}"
    assert main(["export", str(root / name), "--out", str(out)]) == 0
    capsys.readouterr()
    return load_file(str(out / "model.safetensors"))


@pytest.mark.heavy
@pytest.mark.distributed
def test_heavy_export_writes_whole_tensors_from_any_layout(heavy, tmp_path, capsys):
    """seqpar export of a tp2 x sp2 checkpoint (TP DTensors) and of an ep2 one (expert shards): a plain
    transformers checkpoint whose every tensor equals the other layout's export (float64), the experts
    whole; the tp run's own --export-hf (save_pretrained, DTensors gathered) writes the same."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, _ = heavy
    for name, ref in (("tp2sp2", "sp4"), ("ep2", "ep1")):
        got, want = _exported(root, name, tmp_path, capsys), _exported(root, ref, tmp_path, capsys)
        assert set(got) == set(want) and got
        for k in want:
            assert got[k].shape == want[k].shape, k
            assert float((got[k] - want[k]).abs().max()) <= 1e-12, k
        if name == "ep2":  # transformers writes Qwen3-MoE's stacked experts one by one: all 4 of each layer
            for layer in (0, 1):
                held = {k.split(".experts.")[1].split(".")[0] for k in got if f"layers.{layer}.mlp.experts." in k}
                assert held == {"0", "1", "2", "3"}, (layer, held)
        AutoModelForCausalLM.from_pretrained(str(tmp_path / f"export_{name}"))  # a plain transformers checkpoint
    hf = load_file(str(root / "tp2sp2" / "hf" / "model.safetensors"))
    exported = _exported(root, "tp2sp2", tmp_path, capsys, tag="_again")
    assert set(hf) == set(exported) and all(torch.equal(hf[k], exported[k]) for k in hf)


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(PLANS))
def test_heavy_plan_auto_runs(heavy, name):
    _, out = heavy
    got = out[f"plan_{name}"]
    assert len(got["losses"]) == BASE.steps and all(torch.isfinite(torch.tensor(got["losses"])))
    assert got["losses"][-1] < got["losses"][0]
