"""seqpar train on the N-D mesh: --tp and --ep, checkpoints that resume at another layout, export
from any layout, --plan auto (issue 46).

    make test    (4 gloo ranks, one start; and one single process) float64: --tp 2 --sp 2 trains to the
                 losses, gradient norms and held-out loss of --sp 4 and of --sp 1 on one process; a
                 checkpoint written at --tp 2 --sp 2 resumes at --sp 4 and at --sp 2 (dp 2, the same rows
                 per step) to the uninterrupted run's losses; --ep 2 (tiny-qwen3-moe) trains to --ep 1's
                 losses and resumes exactly; the refusals by name (pure).
    make verify  (heavy) the same in float32 (to rounding) and under FSDP2 (2-D DTensors); an --ep 2
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
@pytest.mark.parametrize("other", ["sp4", "sp1"])
def test_tp2_sp2_trains_to_the_losses_of_sp4_and_of_one_process(fast, other):
    """float64: the same rows, the same losses step by step (the loss counted once per dp group, not
    per tp rank), the same clipped gradient norms (tp shards summed over tp), the same held-out loss."""
    tp, ref = fast["tp2sp2"], fast[other]
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
