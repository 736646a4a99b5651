"""The loop of ``seqpar train``, on every rank: the run started (:func:`start_run`: the mesh, the model,
the objective, the schedule of steps, the optimizer), then save dir, resume, the steps with their
progress bar and metrics (:mod:`.report`), checkpoints, evaluations, the summary and the transformers
export. What a step does is :mod:`.step` (static) and :mod:`.dynamic`."""

from __future__ import annotations

import math
import os
import pickle
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import seqpar
from seqpar.comm import collectives, faults
from seqpar.comm.mesh import axis_group

from . import checkpoint as ckpt
from .config import describe_memory
from .context import RunContext, rank_device
from .dynamic import DynamicSteps
from .export import export_run
from .job import Job
from .lora import describe_lora
from .model_setup import RankModel, build_rank_model, make_reference, saved_config
from .objective_step import ObjectiveStep
from .report import (
    HF_DIR,
    METRICS_FILE,
    OUTPUTS,
    PLOT_FILE,
    SUMMARY_FILE,
    EvalResult,
    MetricsLog,
    plot_losses,
    write_summary,
)
from .sources import DataSource
from .step import Optimization, StaticSteps


@dataclass(frozen=True)
class RunSummary:
    """What a run did (the same on every rank); ``seqpar train`` prints it."""

    steps: int  # optimizer steps done in total (resumed ones included)
    losses: list[tuple[int, float]]  # (step, global loss) of the steps run now
    peak_mem_mib: list[float]  # per rank, at the last step: CUDA peak allocated since setup, or peak RSS
    peak_reserved_mib: list[float]  # per rank: CUDA peak reserved since setup (= peak_mem_mib on the CPU)
    train_time_s: float
    first_eval: EvalResult | None  # before training (from the checkpoint when resumed)
    final_eval: EvalResult | None  # after the last step (None if stopped early)
    chance: float | None  # accuracy of guessing (the copy task), None for text data
    data: str  # what the data is, in words
    metrics: str  # path of metrics.jsonl
    checkpoint: str | None  # path of the last complete checkpoint
    skipped: list[int]  # --on-nonfinite skip: the steps whose update was dropped (NaN / Inf)
    evals: list[tuple[int, EvalResult]]  # (step, result) of the evaluations of this run (--eval-every, final)
    world: int
    sp: int
    dp: int
    strategy: str
    layout: str
    params: int
    fsdp: bool
    device: str
    tokens_per_step: int
    resumed_from: str | None
    resumed_step: int  # the step resumed from (0 for a fresh run)
    replaced_previous: bool  # a fresh run cleared an earlier run's save dir
    replaced_steps: list[int]  # --overwrite: the steps of the earlier run's checkpoints it deleted
    trainable: int  # parameters the optimizer trains (all of them, or LoRA's adapters)
    lora: str  # the LoRA adapters, in words ("" without)
    summary_file: str | None  # summary.json (rank 0 writes it after the summary is built)
    plot: str | None  # loss.png
    export: str | None  # --export-hf: the save_pretrained directory
    export_lora: str  # what it holds of a LoRA run: "merged" or "adapter" ("" without LoRA)
    reason: str  # why --strategy auto chose what it chose
    attention: str  # the local attention kernel, in words (seqpar.attention_kernel)
    dtype: str  # the compute dtype (--dtype auto resolved)
    memory: str  # the memory switches, in words
    setup_s: float
    eval_s: float
    sp_degrees: dict[int, int] = field(default_factory=dict)  # --sp-schedule dynamic: units run at each degree
    sp_unit: str = "rows"  # what sp_degrees counts: rows, or documents (--packing: packed rows binned apart)
    sp_cost: str = ""  # --sp-schedule dynamic: the cost model it balanced with (measured: its constants, the seconds)
    objective: str = "sft"  # --objective
    tp: int = 1  # --tp, and --ep
    ep: int = 1
    plan: str = ""  # --plan auto: what it chose and why
    accuracy_of: str = "answers"  # what the held-out accuracy counts, in words (the objective's)
    samples: str | None = None  # the objective's picture of what it learnt (flow-matching: samples.png)

    @property
    def first_loss(self) -> float | None:
        return self.losses[0][1] if self.losses else None

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1][1] if self.losses else None


def peak_memory_mib(device: torch.device) -> tuple[float, float]:
    """This process's peak memory: ``(allocated, reserved)`` by the CUDA caching allocator since the
    last :func:`reset_peak_memory` (reserved is what the GPU really gives the process, NCCL's own
    buffers excepted), or ``(peak RSS, peak RSS)`` on the CPU (since the process started)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, torch.cuda.max_memory_reserved(device) / 2**20
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux (bytes on macOS)
    rss = kib / (2**20 if sys.platform == "darwin" else 2**10)
    return rss, rss


def reset_peak_memory(device: torch.device) -> None:
    """Start the CUDA peaks afresh (after setup: loading and sharding are not the step's memory).
    The CPU's peak RSS cannot be reset; it counts from the process start."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class Run:
    """One rank's run, started: its context (mesh, model, reference), the model as built, the
    objective in the step, the schedule of steps (static or dynamic: ``forward_backward(step)``) and
    the optimization."""

    ctx: RunContext
    built: RankModel
    objective: ObjectiveStep
    steps: StaticSteps | DynamicSteps
    optimization: Optimization

    @property
    def model(self) -> nn.Module:
        return self.ctx.model

    @property
    def data(self) -> DataSource:
        assert self.ctx.job.data is not None  # prepare_job read it
        return self.ctx.job.data

    @property
    def dynamic(self) -> DynamicSteps | None:
        return self.steps if isinstance(self.steps, DynamicSteps) else None

    def evaluate(self) -> EvalResult | None:
        """The held-out evaluation (every rank)."""
        return self.objective.evaluate(self.data)


def start_run(job: Job) -> Run:
    """Start ``job`` on this rank (inside the process group): the mesh, the model with its weights
    (:mod:`.model_setup`), the reference, the objective, the schedule of steps and the optimizer."""
    world = dist.get_world_size()
    if world != job.world:
        raise ValueError(f"the job was prepared for {job.world} ranks but runs on {world}")
    if job.data is None:
        raise ValueError("the job holds no data: prepare it with seqpar.train.prepare_job")
    device = rank_device()
    mesh = seqpar.init_mesh(**job.mesh_kwargs, device_type=device.type)
    built = build_rank_model(job, mesh, device, dist.get_rank())
    ctx = RunContext(job=job, mesh=mesh, device=device, rank=dist.get_rank(),
                     dp_rank=dist.get_rank(axis_group(mesh, "dp")),
                     sp_rank=dist.get_rank(axis_group(mesh, "sp")),  # hybrid: the flattened ring x ulysses axis
                     model=built.model, policy=built.policy, reference=make_reference(job, built),
                     use_fsdp=built.use_fsdp, tp_rank=dist.get_rank(axis_group(mesh, "tp")) if job.tp > 1 else 0)
    objective = ObjectiveStep(ctx)
    optimization = Optimization(job.cfg, built.model)
    steps = (DynamicSteps(ctx, objective, job.data) if job.cfg.sp_schedule == "dynamic"  # collective: block groups
             else StaticSteps(ctx, objective, job.data))
    return Run(ctx, built, objective, steps, optimization)


def _gather_stats(ctx: RunContext, loss_share: float) -> tuple[float, list[float], list[float]]:
    """One all-gather: the step's global loss (sum of the dp ranks' shares, each from one of its sp x tp
    ranks) and every rank's peak memory, allocated and reserved (:func:`peak_memory_mib`)."""
    world = ctx.job.world
    row = torch.tensor([loss_share if ctx.sp_rank == ctx.tp_rank == 0 else 0.0, *peak_memory_mib(ctx.device)],
                       dtype=torch.float64, device=ctx.device)
    table = torch.empty(world * 3, dtype=torch.float64, device=ctx.device)
    collectives.all_gather_flat(table, row)
    table = table.view(world, 3).tolist()  # the step's one host read of its statistics
    return sum(r[0] for r in table), [r[1] for r in table], [r[2] for r in table]


def _prepare_save_dir(ctx: RunContext) -> bool:
    """Rank 0, for a fresh run (``--resume auto`` without a checkpoint too): clear an earlier run's
    outputs (prepare_job refused to delete checkpoints without --overwrite). Returns whether there
    was an earlier run."""
    cfg = ctx.job.cfg
    replaced = False
    if ctx.rank == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)
        if ctx.job.resume_from is None:
            gone = [ckpt.checkpoint_root(cfg.save_dir), os.path.join(cfg.save_dir, HF_DIR),
                    *(os.path.join(cfg.save_dir, f) for f in OUTPUTS)]
            replaced = any(os.path.exists(p) for p in gone)
            for path in gone:
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.exists(path):
                    os.remove(path)
    dist.barrier()
    return replaced


def run_training(job: Job, *, stop_after: int | None = None) -> RunSummary:
    """Train as configured (every rank calls this inside the process group); returns a summary
    (the same on every rank). ``stop_after``: leave after that many steps in total (as if
    interrupted right after the checkpoint of that step), for tests of --resume."""
    cfg = job.cfg
    t_setup = time.perf_counter()
    # Subnormal floats (below 1.2e-38 in float32) cost the CPU ~100x per operation: once attention
    # sharpens on the copy task, its softmax and their gradients fill with them and a step took 3.5x
    # the CPU time (0.28 -> 1.0 s at step 100, measured). Flushed to zero they add nothing a float32 loss
    # can show. This thread only (the steps and evaluations run on it); no effect on CUDA kernels.
    torch.set_flush_denormal(True)
    run = start_run(job)
    ctx, opt = run.ctx, run.optimization
    replaced = _prepare_save_dir(ctx)
    resume_from = job.resume_from  # found and checked by prepare_job
    first_eval = None
    if resume_from is not None:
        state = ckpt.load_checkpoint(resume_from, ctx.model, opt.optimizer, opt.scheduler, mesh=ctx.mesh)
        opt.step = int(state["step"])
        first_eval = state.get("first_eval")
    log = None
    if ctx.rank == 0:
        log = MetricsLog(cfg.save_dir, cfg.report_to, resumed_step=opt.step if resume_from else None,
                         config=cfg.to_dict())
    setup_s = time.perf_counter() - t_setup
    reset_peak_memory(ctx.device)  # the steps' peaks, not the loading's
    t_eval = time.perf_counter()
    if resume_from is None:
        first_eval = run.evaluate()
        if log is not None:
            log.eval(0, first_eval)
    eval_s = time.perf_counter() - t_eval

    trainer_state = {"config": cfg.to_dict(), "dp": job.dp, "sp": job.sp, "tp": job.tp, "ep": job.ep,
                     "world": job.world, "strategy": job.strategy, "first_eval": first_eval}
    last = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = None
    if ctx.rank == 0 and cfg.progress:
        print(f"seqpar train: attention {run.built.attention} ({job.layout} layout); {run.built.dtype}; memory: "
              f"{describe_memory(cfg)}", file=sys.stderr, flush=True)
        import threading

        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock: os._exit would leak it
        bar = tqdm(total=cfg.steps, initial=opt.step, desc="seqpar train", unit="step", file=sys.stderr,
                   dynamic_ncols=True, mininterval=0.5)
    tokens_per_step = job.dp * cfg.micro_batch * cfg.grad_accum * cfg.seq_len * run.data.rows_per_unit
    losses: list[tuple[int, float]] = []
    evals: list[tuple[int, EvalResult]] = []
    mem: list[float] = []
    reserved: list[float] = []
    saved = None
    skipped: list[int] = []
    dyn = run.dynamic  # --sp-schedule dynamic: the step's real tokens and degree histogram
    t_start = time.perf_counter()
    try:
        while opt.step < last:
            t0 = time.perf_counter()
            with faults.publishing("seqpar train's step"):  # what the places inside did not publish
                share, n_units = run.steps.forward_backward(opt.step)
                lr, norm = opt.lr, opt.grad_norm()
                # the step's loss before its update: a NaN / Inf is seen at the step it appears
                loss, mem, reserved = _gather_stats(ctx, share)
            finite = math.isfinite(loss) and math.isfinite(norm[1])  # the same on every rank
            if not finite and cfg.on_nonfinite == "stop":
                raise ValueError(nonfinite_message(opt.step + 1, loss, norm[1], saved or job.resume_from))
            with faults.publishing("the optimizer step"):
                if finite:
                    grad_norm = opt.apply(norm)  # opt.step: steps done, so this is step 1, 2, ...
                else:
                    opt.skip()
                    grad_norm = norm[1]
                    skipped.append(opt.step)
            dt = time.perf_counter() - t0
            tokens_per_step = dyn.last_tokens if dyn is not None else tokens_per_step
            losses.append((opt.step, loss))
            if log is not None:
                log.train({"step": opt.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "targets": n_units,
                           "tokens": tokens_per_step, "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                           "peak_mem_mib": [round(m, 1) for m in mem],
                           "peak_reserved_mib": [round(m, 1) for m in reserved],
                           **({f"{dyn.unit}_at_degree": dyn.last} if dyn is not None else {}),
                           **run.objective.metrics,  # rewards/..., logps/...: over every unit of the step
                           **({"skipped": "non-finite loss or gradient norm"} if not finite else {})})
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"loss {loss:.4f} | {tokens_per_step / dt:,.0f} tok/s | peak mem/rank "
                                    f"{'/'.join(f'{m:.0f}' for m in mem)} MiB"
                                    f"{' | ' + dyn.describe_last() if dyn is not None else ''}", refresh=False)
            if cfg.eval_every and opt.step % cfg.eval_every == 0 and opt.step < cfg.steps:
                t_eval = time.perf_counter()
                with faults.publishing("the evaluation"):
                    result = run.evaluate()  # before the checkpoint: a resumed run keeps this line
                eval_s += time.perf_counter() - t_eval
                if result is not None:
                    evals.append((opt.step, result))
                if log is not None:
                    log.eval(opt.step, result)
            due = cfg.save_every and opt.step % cfg.save_every == 0
            if due or opt.step == last:
                saved = ckpt.save_checkpoint(cfg.save_dir, opt.step, ctx.model, opt.optimizer, opt.scheduler,
                                             trainer_state, keep=cfg.keep_checkpoints,
                                             model_config=saved_config(ctx.model), tokenizer=job.tokenizer,
                                             mesh=ctx.mesh)
        train_time = time.perf_counter() - t_start
        t_eval = time.perf_counter()
        with faults.publishing("the evaluation"):
            final_eval = run.evaluate() if opt.step >= cfg.steps else None
        eval_s += time.perf_counter() - t_eval
        if final_eval is not None:
            evals.append((opt.step, final_eval))
            if log is not None:
                log.eval(opt.step, final_eval)
    finally:
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
    samples = None
    if cfg.plot and opt.step >= cfg.steps and run.objective.spec.finish is not None:
        with faults.publishing("the samples"):
            samples = run.objective.spec.finish(ctx, run.data)  # a picture of what it learnt (flow-matching)
    export = None
    if cfg.export_hf and opt.step >= cfg.steps:
        export = os.path.abspath(os.path.join(cfg.save_dir, HF_DIR))
        export_run(ctx, export)
    if saved is None:
        saved = ckpt.latest_checkpoint(cfg.save_dir)
    plot = os.path.abspath(os.path.join(cfg.save_dir, PLOT_FILE)) if cfg.plot else None
    spec = run.objective.spec
    summary = RunSummary(
        steps=opt.step, losses=losses, peak_mem_mib=mem, peak_reserved_mib=reserved, train_time_s=train_time,
        first_eval=first_eval, final_eval=final_eval, evals=evals, chance=run.data.chance,
        data=run.data.describe(), metrics=os.path.abspath(os.path.join(cfg.save_dir, METRICS_FILE)),
        checkpoint=os.path.abspath(saved) if saved else None, skipped=skipped, world=job.world, sp=job.sp, dp=job.dp,
        tp=job.tp, ep=job.ep, plan=job.plan_reason,
        strategy=job.strategy, layout=job.layout, params=run.built.params, trainable=run.built.trainable,
        lora=describe_lora(cfg), fsdp=ctx.use_fsdp, device=str(ctx.device), tokens_per_step=tokens_per_step,
        resumed_from=os.path.abspath(resume_from) if resume_from else None, resumed_step=job.resume_step,
        replaced_previous=replaced, replaced_steps=list(job.replaces), reason=job.reason,
        attention=run.built.attention, dtype=run.built.dtype, memory=describe_memory(cfg), setup_s=setup_s,
        eval_s=eval_s, summary_file=os.path.abspath(os.path.join(cfg.save_dir, SUMMARY_FILE)), plot=plot,
        export=export, export_lora=cfg.lora_export if cfg.lora_r and export else "", objective=cfg.objective,
        accuracy_of=spec.accuracy_of, samples=samples,
        sp_degrees=dict(dyn.rows_at_degree) if dyn is not None else {},
        sp_unit=dyn.unit if dyn is not None else "rows",
        sp_cost=dyn.describe_cost() if dyn is not None else "")
    if ctx.rank == 0:
        if plot is not None:
            plot_losses(cfg.save_dir)
        write_summary(cfg.save_dir, summary)
    dist.barrier()  # every rank returns once the files are there
    return summary


def nonfinite_message(step: int, loss: float, norm: float, last_good: str | None) -> str:
    """What every rank raises when step ``step``'s loss or gradient norm is NaN / Inf (--on-nonfinite stop)."""
    where = f"the last good checkpoint is {os.path.abspath(last_good)}" if last_good else "no checkpoint was saved yet"
    return (f"the loss became {loss} at step {step} (gradient norm {norm}), so every rank stopped before its update; "
            f"{where}. Lower --lr or use --dtype float32, or --on-nonfinite skip to drop such steps' updates")


def local_worker(rank: int, world: int, job: bytes, stop_after: int | None = None) -> RunSummary:
    """Entry point of a local (gloo) worker started by :func:`seqpar.comm.launch.run_distributed`:
    ``job`` is the parent's prepared :class:`~.job.Job`, pickled (its data too: read once). A
    ValueError propagates: the launcher turns it into one message."""
    die_with_parent()
    import threading

    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank is noise
    # any tqdm a library makes here (peft's merge, even disabled) would create tqdm's default
    # multiprocessing lock, which the worker's os._exit leaks: a thread lock instead
    tqdm.set_lock(threading.RLock())
    return run_training(pickle.loads(job), stop_after=stop_after)


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent (the forkserver, torchrun's agent) goes away, so a killed
    launcher never leaves workers behind."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        parent = os.getppid()
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it went away before the call: the signal will not come
            os.kill(os.getpid(), signal.SIGKILL)
    except Exception:
        pass
