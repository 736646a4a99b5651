"""The fault suite: one rank raises anywhere in a step of a user's own ``parallelize`` loop (the
model's forward, seqpar's attention, the loss, the backward, sync_gradients, the optimizer step, a
torch.distributed.checkpoint save); every other rank must raise RankFailed naming that rank and its
exception -- the same message on each -- within fault_inject.BOUND_S of the fault, and no rank may
hang. A rank that catches the error and goes on never pairs its collectives with another batch; an
error raised on every rank in the same batch leaves the job usable (the loss curve then equals the
run that skipped that batch); a checkpoint save that fails on one rank (a full disk, a permission
error) raises on every rank and leaves the previous checkpoint complete.

Each fault needs fresh processes (a collective may be left pending), so the ranks are zygotes
started once per module that fork one job per case (seqpar.testing.zygote): about 0.5 s a case.
P = 2 runs in make test; P = 3 and 4, every place on the first and the last rank, are heavy."""

import errno
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from seqpar.comm.launch import Failure
from seqpar.testing.fault_inject import BOUND_S, Case, InjectedFault, Injector, outcome_problems
from seqpar.testing.user_loop import USER_PLACES, user_loop
from seqpar.testing.zygote import Zygotes

pytestmark = pytest.mark.distributed

PRELOAD = ("seqpar", "transformers", "seqpar.integrations.models", "transformers.models.llama.modeling_llama",
           "torch.distributed.checkpoint")
"""What the zygotes import once (a forked job that imports a transformers model itself takes seconds)."""


@pytest.fixture(scope="module")
def jobs():
    with Zygotes(2, preload=PRELOAD) as z:
        yield z


def _check_cases(z, cases, tmp_path):
    problems, latency = [], {}
    for case in cases:
        d = tmp_path / case.label().replace("/", "_")
        d.mkdir()
        outs = z.run(user_loop, case, str(d), timeout=90, pg_timeout=60, strict=False)
        if any(isinstance(o, Failure) for o in outs):  # a hang or a death: the launcher's deadline caught it
            problems.append(f"{case.label()}: {[str(o)[:500] for o in outs]}")
            continue
        problems += [f"{case.label()}: {p}" for p in outcome_problems(case, outs)]
        if outs[case.rank].t_fault is not None:
            latency[case.label()] = max(o.t for o in outs) - outs[case.rank].t_fault
    assert not problems, "\n".join(problems)
    assert max(latency.values()) < BOUND_S, latency
    return latency


def test_one_rank_failing_anywhere_in_a_step_stops_every_rank(jobs, tmp_path):
    _check_cases(jobs, [Case(p, rank=1) for p in USER_PLACES], tmp_path)


@pytest.mark.heavy
@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_rank_failing_anywhere_at_two_three_and_four_ranks(world, jobs, tmp_path):
    cases = [Case(p, rank=r, step=s) for p in USER_PLACES for r in (0, world - 1) for s in (0, 2)]
    if world == 2:
        _check_cases(jobs, cases, tmp_path)
        return
    with Zygotes(world, preload=PRELOAD) as z:
        _check_cases(z, cases, tmp_path)


class _EveryRank(Injector):
    """Fires on every rank (a deterministic error: the same bad batch everywhere)."""

    def fires(self, place):
        return self.case.place == place and self.step == self.case.step


def _catching_loop(rank, world, place, every):
    """A user loop that catches the injected error and skips to the next batch (step 1 fails: on
    rank 1, or on every rank); returns ("done", per-step losses) or what ended it and at which step.
    First the same loop without the fault, skipping batch 1 itself: the reference curve."""
    import seqpar
    from seqpar.integrations.models import build_model

    def run(injector):
        torch.manual_seed(0)
        model, _ = build_model("tiny-llama", dtype=torch.float32)
        mesh = seqpar.init_mesh(sp=world, device_type="cpu")
        seqpar.parallelize(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if injector is not None:
            injector.install(model)
        g = torch.Generator().manual_seed(1)
        losses = []
        for step in range(4):
            ids = torch.randint(0, 128, (1, 48), generator=g)
            if injector is None and step == 1:
                continue  # the reference skips the batch the faulty run fails on
            try:
                if injector is not None:
                    injector.step = step
                local = seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh)
                loss = model(**local).loss
                loss.backward()
                seqpar.sync_gradients(model, mesh)
            except InjectedFault:
                opt.zero_grad()
                continue  # "skip the bad batch"
            except Exception as e:
                return type(e).__name__, str(e), step
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return "done", losses

    reference = run(None)
    case = Case(place, rank=1, step=1)
    return reference, run(_EveryRank(case) if every else Injector(case))


def test_a_caught_error_never_pairs_with_the_next_batch(jobs):
    for place in ("forward", "backward"):
        (ref0, (kind0, msg0, step0)), (_, (kind1, msg1, step1)) = jobs.run(_catching_loop, place, False, timeout=90)
        assert ref0[0] == "done"
        # rank 0 was waiting in batch 1's collectives: it stops there, naming rank 1
        assert kind0 == "RankFailed" and step0 == 1 and "rank 1 failed in" in msg0, (place, msg0)
        # rank 1 went on: its next batch refuses to start (the same cause), instead of pairing with batch 1
        assert step1 == 2, (place, kind1, msg1)
        # the backward's failure was published as it left the engine, as the forward's is
        assert kind1 == "RankFailed" and msg1 == msg0 and "InjectedFault" in msg0, (place, msg1)
        # (batch numbers count the reference run's 3 batches too: batch 1 of this run is number 5)
        assert f"rank 1 failed in the {place} (batch 5)" in msg0, msg0


def test_an_error_on_every_rank_in_the_same_batch_leaves_the_job_usable(jobs):
    results = jobs.run(_catching_loop, "forward", True, timeout=90)
    for reference, faulty in results:
        assert reference[0] == "done" and faulty[0] == "done", faulty
        assert faulty[1] == reference[1]  # the batch that failed everywhere is skipped, exactly
    assert results[0][1] == results[1][1]


def _tiny_state(seed):
    torch.manual_seed(seed)
    model = nn.Linear(6, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _failing_save(rank, world, root, fail, step):
    """Save step 1, then save ``step`` with one rank's write failing (``fail``); what each rank raised,
    what the checkpoint folder holds after, and whether step 1 is intact and holds step 1's weights."""
    from seqpar.train import checkpoint as ckpt

    model, opt, sched = _tiny_state(0)
    first = ckpt.save_checkpoint(root, 1, model, opt, sched, {"world": world}, keep=3)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model2, opt2, sched2 = _tiny_state(1)
    real = torch.save

    def save(obj, f, *args, **kwargs):
        name = os.path.basename(str(f))
        if fail == "enospc" and rank == 1 and name.startswith("rng_rank"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        if fail == "permission" and rank == 0 and name == ckpt.TRAINER_FILE:
            raise PermissionError(errno.EACCES, "Permission denied", str(f))
        return real(obj, f, *args, **kwargs)

    torch.save = save
    try:
        ckpt.save_checkpoint(root, step, model2, opt2, sched2, {"world": world}, keep=3)
        raised = None
    except Exception as e:
        raised = (type(e).__name__, str(e))
    finally:
        torch.save = real
    dist.barrier()  # every rank's view after rank 0's clean-up
    fresh, _, _ = _tiny_state(2)
    ckpt.load_model_weights(first, fresh)
    same = all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    return raised, sorted(os.listdir(ckpt.checkpoint_root(root))), ckpt.damaged(first), same


def test_a_failed_checkpoint_write_raises_everywhere_and_keeps_the_previous_one(jobs, tmp_path):
    for fail, rank, text in (("enospc", 1, "OSError: [Errno 28] No space left on device"),
                             ("permission", 0, "PermissionError: [Errno 13] Permission denied")):
        for step in (2, 1):  # a new step, and a re-save of the complete one (a resumed run)
            root = tmp_path / f"{fail}{step}"
            out = jobs.run(_failing_save, str(root), fail, step, timeout=90)
            messages = {r[0][1] for r in out}
            assert len(messages) == 1, out  # the same message on every rank
            (msg,) = messages
            assert f"rank {rank}: {text}" in msg and f"the checkpoint save of step {step} failed" in msg, msg
            for _, listing, damage, same in out:
                assert listing == ["step_00000001"], listing  # the partial one is gone, the previous one kept
                assert damage == [] and same


def test_a_checkpoint_saved_by_every_rank_has_every_rank_manifest(jobs, tmp_path):
    from seqpar.train.manifest import MANIFEST

    out = jobs.run(_failing_save, str(tmp_path), "none", 2, timeout=90)
    assert all(r[0] is None and r[1] == ["step_00000001", "step_00000002"] for r in out), out
    for step in (1, 2):
        path = tmp_path / "checkpoints" / f"step_{step:08d}"
        assert {MANIFEST.format(rank=r) for r in range(2)} <= set(os.listdir(path))


# --------------------------------------------------------------------------------------------
# seqpar train: the same faults inside its loop (the places its own code offers), NaN at step k
# --------------------------------------------------------------------------------------------

TRAIN_PLACES = ("forward", "attention", "loss", "backward", "sync", "optimizer", "save")


def _train_case(rank, world, case, cfg):
    """seqpar train's worker (run_training) with ``case`` injected; what this rank raised, or the
    steps --on-nonfinite skip dropped."""
    from seqpar.testing.fault_inject import run_case
    from seqpar.train import checkpoint as ckpt
    from seqpar.train.job import prepare_job
    from seqpar.train.loop import run_training
    from seqpar.train.step import Optimization, StaticSteps

    def body(inj):
        fb, step, save = StaticSteps.forward_backward, Optimization.apply, ckpt._save

        def forward_backward(self, step_done, *args, **kwargs):
            inj.install(self.ctx.model)
            inj.step = step_done
            return fb(self, step_done, *args, **kwargs)

        def apply(self, *args, **kwargs):
            inj.boom("optimizer")
            return step(self, *args, **kwargs)

        def save_inside(*args, **kwargs):
            inj.boom("save")
            return save(*args, **kwargs)

        StaticSteps.forward_backward, Optimization.apply, ckpt._save = forward_backward, apply, save_inside
        try:
            return run_training(prepare_job(cfg, world)).skipped
        finally:
            StaticSteps.forward_backward, Optimization.apply, ckpt._save = fb, step, save

    return run_case(case, body)


def _train_cfg(save_dir, **kw):
    from seqpar.train.config import TrainConfig

    return TrainConfig(seq_len=32, micro_batch=1, steps=3, save_every=1, keep_checkpoints=3, progress=False, plot=False,
                       eval_rows=0, tiled_loss=False, tiled_mlp=False, checkpoint="none", save_dir=str(save_dir), **kw)


def _check_train_cases(z, places, tmp_path):
    problems, latency = [], {}
    for place in places:
        case = Case(place, rank=z.nproc - 1)
        outs = z.run(_train_case, case, _train_cfg(tmp_path / place), timeout=90, pg_timeout=60, strict=False)
        if any(isinstance(o, Failure) for o in outs):
            problems.append(f"{case.label()}: {[str(o)[:500] for o in outs]}")
            continue
        problems += [f"seqpar train {case.label()}: {p}" for p in outcome_problems(case, outs)]
        if outs[case.rank].t_fault is not None:
            latency[place] = max(o.t for o in outs) - outs[case.rank].t_fault
    assert not problems, "\n".join(problems)
    return latency


def test_seqpar_train_stops_every_rank_on_one_ranks_fault(jobs, tmp_path):
    _check_train_cases(jobs, ("forward", "save"), tmp_path)


@pytest.mark.heavy
def test_seqpar_train_stops_every_rank_at_every_place(jobs, tmp_path):
    _check_train_cases(jobs, TRAIN_PLACES, tmp_path)


def test_a_nan_at_step_k_stops_or_is_skipped_on_every_rank(jobs, tmp_path):
    case = Case("nan", rank=1, step=1)  # rank 1's activations become NaN in the run's second step
    outs = jobs.run(_train_case, case, _train_cfg(tmp_path / "stop"), timeout=90)
    last_good = os.path.join(str(tmp_path / "stop"), "checkpoints", "step_00000001")
    assert {o.raised for o in outs} == {"ValueError"} and len({o.message for o in outs}) == 1, outs
    msg = outs[0].message
    assert "the loss became nan at step 2" in msg and f"the last good checkpoint is {last_good}" in msg, msg
    assert "--on-nonfinite skip" in msg
    outs = jobs.run(_train_case, case, _train_cfg(tmp_path / "skip", on_nonfinite="skip"), timeout=90)
    assert [(o.raised, o.extra) for o in outs] == [(None, [2])] * 2, outs  # the run went on without step 2's update


# --------------------------------------------------------------------------------------------
# the Trainer integration: the same faults inside transformers' Trainer with seqpar's mixin
# --------------------------------------------------------------------------------------------

TRAINER_PLACES = ("forward", "attention", "loss", "backward", "optimizer")


def _trainer_case(rank, world, case, out):
    """A stock transformers Trainer made sequence-parallel by parallelize_trainer, ``case`` injected
    (the optimizer place: a callback at the step's end, the user's code between backward and update)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import seqpar
    from seqpar.integrations.models import build_model
    from seqpar.integrations.trainer.mixin import parallelize_trainer
    from seqpar.testing.fault_inject import run_case

    def body(inj):
        torch.manual_seed(0)
        model, _ = build_model("tiny-llama", dtype=torch.float32)
        g = torch.Generator().manual_seed(1)
        rows = [{"input_ids": (ids := torch.randint(3, 128, (24,), generator=g).tolist()), "labels": ids}
                for _ in range(16)]

        class Steps(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                inj.step = state.global_step

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                inj.boom("optimizer")

        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
                                 report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1)
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Steps()])
        parallelize_trainer(trainer, seqpar.init_mesh(sp=world, device_type="cpu"))
        inj.install(model)
        trainer.train()
        return trainer.state.global_step

    return run_case(case, body)


@pytest.mark.heavy
def test_the_trainer_integration_stops_every_rank_on_one_ranks_fault(tmp_path):
    with Zygotes(2, preload=(*PRELOAD, "transformers.trainer")) as z:
        problems = []
        for place in TRAINER_PLACES:
            case = Case(place, rank=1)
            outs = z.run(_trainer_case, case, str(tmp_path / place), timeout=120, pg_timeout=60, strict=False)
            if any(isinstance(o, Failure) for o in outs):
                problems.append(f"{case.label()}: {[str(o)[:500] for o in outs]}")
                continue
            problems += [f"Trainer {case.label()}: {p}" for p in outcome_problems(case, outs)]
        assert not problems, "\n".join(problems)


def _killed_in_save(rank, world, root):
    """Save step 1, then rank 1 is SIGKILLed in the middle of saving step 2 (its shards written, its RNG
    state not): what rank 0 raised, and what the folder holds after."""
    import signal

    from seqpar.train import checkpoint as ckpt

    model, opt, sched = _tiny_state(0)
    ckpt.save_checkpoint(root, 1, model, opt, sched, {"world": world}, keep=3)
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if rank == 1 and os.path.basename(str(f)).startswith("rng_rank"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(obj, f, *args, **kwargs)

    torch.save = save
    try:
        ckpt.save_checkpoint(root, 2, model, opt, sched, {"world": world}, keep=3)
        raised = None
    except Exception as e:
        raised = type(e).__name__
    finally:
        torch.save = real
    return raised, ckpt.complete_checkpoints(root), ckpt.damaged(ckpt.step_dir(root, 1))


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(jobs, tmp_path):
    first, second = jobs.run(_killed_in_save, str(tmp_path), timeout=90, strict=False)
    assert isinstance(second, Failure) and second.kind == "died" and second.exit_code == -9, second
    raised, found, damage = first
    assert raised is not None  # the peer's death reached rank 0 (no hang)
    assert found == [(1, _ckpt_path(tmp_path, 1))] and damage == []


def _ckpt_path(root, step):
    from seqpar.train.checkpoint import step_dir

    return step_dir(str(root), step)
