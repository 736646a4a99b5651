"""One ``seqpar train`` run on every rank: save dir, resume, the step loop with its progress bar and
metrics (:mod:`.report`), checkpoints, evaluations, the summary and the transformers export."""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from seqpar.comm import collectives, faults

from . import checkpoint as ckpt
from .config import PAIRED, TrainConfig, describe_memory
from .job import Job, prepare_job
from .loop import EvalResult, Trainer, peak_memory_mib, reset_peak_memory
from .lora import describe_lora
from .report import HF_DIR, METRICS_FILE, OUTPUTS, PLOT_FILE, SUMMARY_FILE, MetricsLog, plot_losses, write_summary


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
    objective: str = "sft"  # --objective: the held-out accuracy counts answers (sft) or pairs (the others)

    @property
    def first_loss(self) -> float | None:
        return self.losses[0][1] if self.losses else None

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1][1] if self.losses else None


def _gather_stats(trainer: Trainer, loss_share: float) -> tuple[float, list[float], list[float]]:
    """One all-gather: the step's global loss (sum of the dp ranks' shares) and every rank's peak
    memory, allocated and reserved (:func:`peak_memory_mib`)."""
    row = torch.tensor([loss_share if trainer.sp_rank == 0 else 0.0, *peak_memory_mib(trainer.device)],
                       dtype=torch.float64, device=trainer.device)
    table = torch.empty(trainer.world * 3, dtype=torch.float64, device=trainer.device)
    collectives.all_gather_flat(table, row)
    table = table.view(trainer.world, 3).tolist()  # the step's one host read of its statistics
    return sum(r[0] for r in table), [r[1] for r in table], [r[2] for r in table]


def _prepare_save_dir(trainer: Trainer) -> bool:
    """Rank 0, for a fresh run (``--resume auto`` without a checkpoint too): clear an earlier run's
    outputs (prepare_job refused to delete checkpoints without --overwrite). Returns whether there
    was an earlier run."""
    cfg = trainer.cfg
    replaced = False
    if trainer.rank == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)
        if trainer.job.resume_from is None:
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
    trainer = Trainer(job)
    replaced = _prepare_save_dir(trainer)
    resume_from = job.resume_from  # found and checked by prepare_job
    first_eval = None
    if resume_from is not None:
        state = ckpt.load_checkpoint(resume_from, trainer.model, trainer.optimizer, trainer.scheduler)
        trainer.step = int(state["step"])
        first_eval = state.get("first_eval")
    log = None
    if trainer.rank == 0:
        log = MetricsLog(cfg.save_dir, cfg.report_to, resumed_step=trainer.step if resume_from else None,
                         config=cfg.to_dict())
    setup_s = time.perf_counter() - t_setup
    reset_peak_memory(trainer.device)  # the steps' peaks, not the loading's
    t_eval = time.perf_counter()
    if resume_from is None:
        first_eval = trainer.evaluate()
        if log is not None:
            log.eval(0, first_eval)
    eval_s = time.perf_counter() - t_eval

    trainer_state = {"config": cfg.to_dict(), "dp": job.dp, "sp": job.sp, "world": job.world,
                     "strategy": job.strategy, "first_eval": first_eval}
    last = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = None
    if trainer.rank == 0 and cfg.progress:
        print(f"seqpar train: attention {trainer.attention} ({job.layout} layout); {trainer.dtype}; memory: "
              f"{describe_memory(cfg)}", file=sys.stderr, flush=True)
        import threading

        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock: os._exit would leak it
        bar = tqdm(total=cfg.steps, initial=trainer.step, desc="seqpar train", unit="step", file=sys.stderr,
                   dynamic_ncols=True, mininterval=0.5)
    rows = 2 if cfg.objective in PAIRED and not cfg.packing else 1  # a unit of padded pairs is two rows
    tokens_per_step = job.dp * cfg.micro_batch * cfg.grad_accum * cfg.seq_len * rows
    losses: list[tuple[int, float]] = []
    evals: list[tuple[int, EvalResult]] = []
    mem: list[float] = []
    reserved: list[float] = []
    saved = None
    skipped: list[int] = []
    t_start = time.perf_counter()
    try:
        while trainer.step < last:
            t0 = time.perf_counter()
            with faults.publishing("seqpar train's step"):  # what the places inside did not publish
                share, n_targets = trainer.forward_backward(trainer.step)
                lr = trainer.optimizer.param_groups[0]["lr"]
                norm = trainer.grad_norm()
                # the step's loss before its update: a NaN / Inf is seen at the step it appears
                loss, mem, reserved = _gather_stats(trainer, share)
            finite = math.isfinite(loss) and math.isfinite(norm[1])  # the same on every rank
            if not finite and cfg.on_nonfinite == "stop":
                raise ValueError(nonfinite_message(trainer.step + 1, loss, norm[1], saved or job.resume_from))
            with faults.publishing("the optimizer step"):
                if finite:
                    grad_norm = trainer.optimizer_step(norm)  # trainer.step: steps done, so this is step 1, 2, ...
                else:
                    trainer.skip_step()
                    grad_norm = norm[1]
                    skipped.append(trainer.step)
            dt = time.perf_counter() - t0
            dyn = trainer.dynamic  # --sp-schedule dynamic: the step's real tokens and degree histogram
            tokens_per_step = dyn.last_tokens if dyn is not None else tokens_per_step
            losses.append((trainer.step, loss))
            if log is not None:
                log.train({"step": trainer.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "targets": n_targets,
                           "tokens": tokens_per_step, "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                           "peak_mem_mib": [round(m, 1) for m in mem],
                           "peak_reserved_mib": [round(m, 1) for m in reserved],
                           **({f"{dyn.unit}_at_degree": dyn.last} if dyn is not None else {}),
                           **trainer.objective.metrics,  # rewards/..., logps/...: over every pair of the step
                           **({"skipped": "non-finite loss or gradient norm"} if not finite else {})})
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"loss {loss:.4f} | {tokens_per_step / dt:,.0f} tok/s | peak mem/rank "
                                    f"{'/'.join(f'{m:.0f}' for m in mem)} MiB"
                                    f"{' | ' + dyn.describe_last() if dyn is not None else ''}", refresh=False)
            if cfg.eval_every and trainer.step % cfg.eval_every == 0 and trainer.step < cfg.steps:
                t_eval = time.perf_counter()
                with faults.publishing("the evaluation"):
                    result = trainer.evaluate()  # before the checkpoint: a resumed run keeps this line
                eval_s += time.perf_counter() - t_eval
                if result is not None:
                    evals.append((trainer.step, result))
                if log is not None:
                    log.eval(trainer.step, result)
            due = cfg.save_every and trainer.step % cfg.save_every == 0
            if due or trainer.step == last:
                saved = ckpt.save_checkpoint(cfg.save_dir, trainer.step, trainer.model, trainer.optimizer,
                                             trainer.scheduler, trainer_state, keep=cfg.keep_checkpoints,
                                             model_config=trainer.model.config, tokenizer=trainer.tokenizer)
        train_time = time.perf_counter() - t_start
        t_eval = time.perf_counter()
        with faults.publishing("the evaluation"):
            final_eval = trainer.evaluate() if trainer.step >= cfg.steps else None
        eval_s += time.perf_counter() - t_eval
        if final_eval is not None:
            evals.append((trainer.step, final_eval))
            if log is not None:
                log.eval(trainer.step, final_eval)
    finally:
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
    export = None
    if cfg.export_hf and trainer.step >= cfg.steps:
        from seqpar.integrations.hf.export import save_pretrained

        export = os.path.abspath(os.path.join(cfg.save_dir, HF_DIR))
        save_pretrained(trainer.peft or trainer.model, export, trainer.mesh, tokenizer=trainer.tokenizer,
                        lora=cfg.lora_export)
    if saved is None:
        saved = ckpt.latest_checkpoint(cfg.save_dir)
    plot = os.path.abspath(os.path.join(cfg.save_dir, PLOT_FILE)) if cfg.plot else None
    summary = RunSummary(
        steps=trainer.step, losses=losses, peak_mem_mib=mem, peak_reserved_mib=reserved, train_time_s=train_time,
        first_eval=first_eval, final_eval=final_eval, evals=evals, chance=trainer.data.chance,
        data=trainer.data.describe(), metrics=os.path.abspath(os.path.join(cfg.save_dir, METRICS_FILE)),
        checkpoint=os.path.abspath(saved) if saved else None, skipped=skipped, world=job.world, sp=job.sp, dp=job.dp,
        strategy=job.strategy, layout=job.layout, params=trainer.n_params, trainable=trainer.n_trainable,
        lora=describe_lora(cfg), fsdp=trainer.use_fsdp, device=str(trainer.device), tokens_per_step=tokens_per_step,
        resumed_from=os.path.abspath(resume_from) if resume_from else None, resumed_step=job.resume_step,
        replaced_previous=replaced, replaced_steps=list(job.replaces), reason=job.reason, attention=trainer.attention,
        dtype=trainer.dtype, memory=describe_memory(cfg), setup_s=setup_s, eval_s=eval_s,
        summary_file=os.path.abspath(os.path.join(cfg.save_dir, SUMMARY_FILE)), plot=plot, export=export,
        export_lora=cfg.lora_export if cfg.lora_r and export else "",
        objective=cfg.objective,
        sp_degrees=dict(trainer.dynamic.rows_at_degree) if trainer.dynamic is not None else {},
        sp_unit=trainer.dynamic.unit if trainer.dynamic is not None else "rows",
        sp_cost=trainer.dynamic.describe_cost() if trainer.dynamic is not None else "")
    if trainer.rank == 0:
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


def local_worker(rank: int, world: int, cfg: TrainConfig, stop_after: int | None = None) -> RunSummary:
    """Entry point of a local (gloo) worker started by :func:`seqpar.comm.launch.run_distributed`. A
    ValueError propagates: the launcher turns it into one message."""
    _die_with_parent()
    import threading

    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank is noise
    # any tqdm a library makes here (peft's merge, even disabled) would create tqdm's default
    # multiprocessing lock, which the worker's os._exit leaks: a thread lock instead
    tqdm.set_lock(threading.RLock())
    return run_training(prepare_job(cfg, world, read_data=False), stop_after=stop_after)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent (the forkserver) goes away, so a killed launcher never
    leaves workers behind."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
