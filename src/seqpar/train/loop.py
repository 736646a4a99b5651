"""The training loop of ``seqpar train``: one function every rank runs inside a process group.

Per optimizer step, on every rank::

    rows      this dp rank's micro-batches (rows k = f(seed, step, micro, dp rank): resumable)
    N         seqpar.count_target_tokens(all of them, mesh)      targets of the whole step, all dp
    for each micro-batch:
      local = seqpar.shard_batch(batch, mesh, num_items_in_batch=N)   this SP rank's slice
      model(**local).loss.backward()          loss = exact share of the global token mean
    seqpar.sync_gradients (or FSDP2's reduce-scatter)                  every grad now exact
    clip to the global norm, AdamW, warmup + cosine

so the loss and gradients are those of one big batch on one device, whatever dp, sp, grad_accum.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import seqpar
from seqpar.collectives import all_gather_flat
from seqpar.mesh import axis_group
from seqpar.models import BUILTIN_MODELS, build_model

from . import checkpoint as ckpt
from .config import TrainConfig, model_overrides
from .data import TaskData, TextData, make_rows, read_documents, row_index, stack
from .job import Job, check_resumable, prepare_job
from .tasks import EVAL, IGNORE, CopyTask, answer_accuracy
from .tokenizer import make_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
METRICS_FILE = "metrics.jsonl"


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory so far: the CUDA allocator's peak, or the peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux (bytes on macOS)
    return kib / (2**20 if sys.platform == "darwin" else 2**10)


def use_fsdp(cfg: TrainConfig, device_type: str) -> bool:
    """FSDP2 when asked, and by default with CUDA or bfloat16 (its mixed precision keeps fp32
    master weights; autocast would hand attention q/k in fp32 and v in bf16)."""
    return cfg.fsdp == "on" or (cfg.fsdp == "auto" and (device_type == "cuda" or cfg.dtype == "bfloat16"))


def lr_lambda(cfg: TrainConfig):
    """Linear warmup to 1 over ``warmup`` steps, then cosine down to ``min_lr_ratio``."""
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return f


class Trainer:
    """Model, data, optimizer and mesh of one rank. Needs an initialized process group."""

    def __init__(self, job: Job) -> None:
        cfg = self.cfg = job.cfg
        self.job = job
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != job.world:
            raise ValueError(f"the job was prepared for {job.world} ranks but runs on {self.world}")
        self.device = torch.device("cpu")
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        self.mesh = seqpar.init_mesh(**job.mesh_kwargs, device_type=self.device.type)
        self.dp_rank = dist.get_rank(axis_group(self.mesh, "dp"))
        self.sp_rank = dist.get_rank(axis_group(self.mesh, "sp"))  # hybrid: the flattened ring x ulysses axis

        dtype = DTYPES[cfg.dtype]
        param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        if cfg.model in BUILTIN_MODELS:
            self.data = self._make_data(None)
            model, _ = build_model(cfg.model, dtype=param_dtype, vocab_size=self.data.vocab_size,
                                   max_position_embeddings=cfg.seq_len, **model_overrides(cfg))
        else:
            model, tok = build_model(cfg.model, dtype=param_dtype)
            self.data = self._make_data(tok)
            vocab = int(model.get_input_embeddings().num_embeddings)
            if self.data.vocab_size > vocab:
                raise ValueError(f"the data needs {self.data.vocab_size} token ids but --model {cfg.model!r} has "
                                 f"{vocab}: give the checkpoint its tokenizer or use a built-in model")
        model.to(self.device)
        self.n_params = sum(p.numel() for p in model.parameters())
        seqpar.parallelize(model, self.mesh, strategy=job.strategy)
        self.use_fsdp = use_fsdp(cfg, self.device.type)
        if self.use_fsdp:
            from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

            kw: dict[str, Any] = {}
            if dtype == torch.bfloat16:  # bf16 compute, fp32 master weights and gradient reduction
                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            seqpar.apply_fsdp(model, self.mesh, **kw)
            for module in model.modules():
                # the summed (divide factor 1) reduction as a plain SUM: gloo has no PREMUL_SUM
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.step = 0

    def _make_data(self, hf_tokenizer: Any) -> TaskData | TextData:
        cfg = self.cfg
        if not cfg.data:
            return TaskData(CopyTask(cfg.seq_len, cfg.seed), cfg.eval_rows)
        tok = make_tokenizer(hf_tokenizer)
        docs = [tok.encode(d) for d in read_documents(cfg.data, cfg.text_field)]
        rows = make_rows(docs, cfg.seq_len, packing=cfg.packing, pad_id=tok.pad_id)
        n_tok = sum(len(d) for d in docs)
        what = (f"{len(docs)} documents, {n_tok} tokens ({getattr(tok, 'name', 'tokenizer')}) in {len(rows)} rows"
                f"{' (packed)' if cfg.packing else ''}")
        return TextData(rows, seed=cfg.seed, eval_rows=cfg.eval_rows, vocab_size=tok.vocab_size, describe=what)

    # ----------------------------------------------------------------------------------------
    # one step
    # ----------------------------------------------------------------------------------------

    def micro_batches(self, step: int) -> list[dict[str, Tensor]]:
        cfg = self.cfg
        out = []
        for m in range(cfg.grad_accum):
            rows = [self.data.row(row_index(step, m, self.dp_rank, b, grad_accum=cfg.grad_accum, dp=self.job.dp,
                                            micro_batch=cfg.micro_batch)) for b in range(cfg.micro_batch)]
            out.append({k: v.to(self.device) for k, v in stack(rows).items()})
        return out

    def forward_backward(self, step: int) -> tuple[float, int]:
        """Gradients of the global token-mean loss of ``step`` on every rank (complete and exact
        after this: summed over dp x sp). Returns ``(this dp rank's share of the loss, targets)``."""
        batches = self.micro_batches(step)
        n_items = seqpar.count_target_tokens(batches, self.mesh)
        share = 0.0
        for b in batches:
            local = seqpar.shard_batch(b, self.mesh, layout=self.job.layout, num_items_in_batch=n_items or None)
            loss = self.model(**local).loss
            loss.backward()
            share += float(loss.detach())
        if not self.use_fsdp:
            seqpar.sync_gradients(self.model, self.mesh)
        return share, int(n_items)

    def optimizer_step(self) -> float:
        """Clip to the global gradient norm, step AdamW and the schedule; returns the norm."""
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        # after sync_gradients every rank holds the complete gradients, so the local norm is the
        # global one; under FSDP the norm of the sharded (DTensor) gradients is reduced by torch
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(norm)

    # ----------------------------------------------------------------------------------------
    # evaluation
    # ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Held-out loss and greedy accuracy over the targets of the held-out rows (all ranks)."""
        n = self.data.n_eval
        if n == 0:
            return None
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, targets
        mine = list(range(self.dp_rank, n, self.job.dp))
        rounds = -(-n // self.job.dp)  # every dp rank runs the same number of forwards
        for i in range(rounds):
            idx = mine[i] if i < len(mine) else mine[0] if mine else 0
            batch = {k: v[None].to(self.device) for k, v in self.data.row(idx, EVAL).items()}
            local = seqpar.shard_batch(batch, self.mesh, layout=self.job.layout)
            targets = local.pop("labels")
            local.pop("shift_labels", None)
            logits = self.model(**local).logits
            if i >= len(mine):
                continue  # padding round of a dp rank with fewer rows
            from seqpar.loss import token_losses

            correct, count = answer_accuracy(logits, targets)
            totals += torch.tensor([float(token_losses(logits, targets, IGNORE).sum()), correct, count],
                                   dtype=torch.float64, device=self.device)
        self.model.train()
        dist.all_reduce(totals)
        loss_sum, correct, count = totals.tolist()
        return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1), "targets": int(count)}


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------

def _gather_stats(trainer: Trainer, loss_share: float) -> tuple[float, list[float]]:
    """One all-gather: the step's global loss (sum of the dp ranks' shares) and every rank's peak
    memory."""
    row = torch.tensor([loss_share if trainer.sp_rank == 0 else 0.0, peak_memory_mib(trainer.device)],
                       dtype=torch.float64, device=trainer.device)
    table = torch.empty(trainer.world * 2, dtype=torch.float64, device=trainer.device)
    all_gather_flat(table, row)
    table = table.view(trainer.world, 2)
    return float(table[:, 0].sum()), table[:, 1].tolist()


def _prepare_save_dir(trainer: Trainer) -> tuple[str | None, bool]:
    """Rank 0: for a fresh run, clear an earlier run's metrics and checkpoints; for --resume,
    find the latest complete checkpoint. Returns ``(checkpoint or None, replaced an old run)``."""
    cfg = trainer.cfg
    metrics = os.path.join(cfg.save_dir, METRICS_FILE)
    replaced = False
    path = None
    if cfg.resume:
        path = ckpt.latest_checkpoint(cfg.save_dir)
        if path is None:
            raise ValueError(f"--resume: no complete checkpoint in {ckpt.checkpoint_root(cfg.save_dir)!r}; "
                             "run without --resume to start fresh")
    if trainer.rank == 0:
        os.makedirs(cfg.save_dir, exist_ok=True)
        if not cfg.resume:
            replaced = os.path.exists(metrics) or os.path.isdir(ckpt.checkpoint_root(cfg.save_dir))
            shutil.rmtree(ckpt.checkpoint_root(cfg.save_dir), ignore_errors=True)
            open(metrics, "w").close()
    dist.barrier()
    return path, replaced


def _truncate_metrics(path: str, step: int) -> None:
    """Keep the metric lines up to ``step`` (those after it are about to be recomputed)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(keep)


def run_training(job: Job, *, stop_after: int | None = None) -> dict[str, Any]:
    """Train as configured (every rank calls this inside the process group); returns a summary
    (the same on every rank). ``stop_after``: leave after that many steps in total (as if
    interrupted right after the checkpoint of that step), for tests of --resume."""
    cfg = job.cfg
    t_setup = time.perf_counter()
    trainer = Trainer(job)
    resume_from, replaced = _prepare_save_dir(trainer)
    metrics_path = os.path.join(cfg.save_dir, METRICS_FILE)
    first_eval = None
    if resume_from is not None:
        check_resumable(job, ckpt.read_trainer_state(resume_from), resume_from)
        state = ckpt.load_checkpoint(resume_from, trainer.model, trainer.optimizer, trainer.scheduler)
        trainer.step = int(state["step"])
        first_eval = state.get("first_eval")
        if trainer.rank == 0:
            _truncate_metrics(metrics_path, trainer.step)
    setup_s = time.perf_counter() - t_setup
    t_eval = time.perf_counter()
    if resume_from is None:
        first_eval = trainer.evaluate()
    eval_s = time.perf_counter() - t_eval

    trainer_state = {"config": cfg.to_dict(), "dp": job.dp, "sp": job.sp, "world": job.world,
                     "strategy": job.strategy, "first_eval": first_eval}
    last = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = None
    if trainer.rank == 0 and cfg.progress:
        import threading

        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock: os._exit would leak it
        bar = tqdm(total=cfg.steps, initial=trainer.step, desc="seqpar train", unit="step", file=sys.stderr,
                   dynamic_ncols=True, mininterval=0.5)
    tokens_per_step = job.dp * cfg.micro_batch * cfg.grad_accum * cfg.seq_len
    losses: list[tuple[int, float]] = []
    mem: list[float] = []
    saved = None
    t_start = time.perf_counter()
    metrics = open(metrics_path, "a") if trainer.rank == 0 else None  # noqa: SIM115 -- closed below
    try:
        while trainer.step < last:
            t0 = time.perf_counter()
            share, n_targets = trainer.forward_backward(trainer.step)
            lr = trainer.optimizer.param_groups[0]["lr"]
            grad_norm = trainer.optimizer_step()  # trainer.step: steps done, so this is step 1, 2, ...
            loss, mem = _gather_stats(trainer, share)
            dt = time.perf_counter() - t0
            losses.append((trainer.step, loss))
            if not math.isfinite(loss):
                raise ValueError(f"the loss became {loss} at step {trainer.step}: lower --lr or use --dtype float32")
            if metrics is not None:
                metrics.write(json.dumps({"step": trainer.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                          "targets": n_targets, "tokens": tokens_per_step,
                                          "tokens_per_s": tokens_per_step / dt, "step_time_s": dt,
                                          "peak_mem_mib": [round(m, 1) for m in mem]}) + "\n")
                metrics.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"loss {loss:.4f} | {tokens_per_step / dt:,.0f} tok/s | peak mem/rank "
                                    f"{'/'.join(f'{m:.0f}' for m in mem)} MiB", refresh=False)
            due = cfg.save_every and trainer.step % cfg.save_every == 0
            if due or trainer.step == last:
                saved = ckpt.save_checkpoint(cfg.save_dir, trainer.step, trainer.model, trainer.optimizer,
                                             trainer.scheduler, trainer_state, keep=cfg.keep_checkpoints)
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
    train_time = time.perf_counter() - t_start
    t_eval = time.perf_counter()
    final_eval = trainer.evaluate() if trainer.step >= cfg.steps else None
    eval_s += time.perf_counter() - t_eval
    if saved is None:
        saved = ckpt.latest_checkpoint(cfg.save_dir)
    return {
        "steps": trainer.step, "losses": losses, "first_loss": losses[0][1] if losses else None,
        "last_loss": losses[-1][1] if losses else None, "peak_mem_mib": mem, "train_time_s": train_time,
        "first_eval": first_eval, "final_eval": final_eval, "chance": trainer.data.chance,
        "data": trainer.data.describe(), "metrics": os.path.abspath(metrics_path),
        "checkpoint": os.path.abspath(saved) if saved else None, "world": job.world, "sp": job.sp, "dp": job.dp,
        "strategy": job.strategy, "layout": job.layout, "params": trainer.n_params, "fsdp": trainer.use_fsdp,
        "device": str(trainer.device), "tokens_per_step": tokens_per_step, "resumed_from": resume_from,
        "replaced_previous": replaced, "reason": job.reason, "setup_s": setup_s, "eval_s": eval_s,
    }


def local_worker(rank: int, world: int, cfg: TrainConfig, stop_after: int | None = None) -> dict[str, Any]:
    """Entry point of a local (gloo) worker started by :func:`seqpar.launch.run_distributed`. A
    ValueError propagates: the launcher turns it into one message."""
    _die_with_parent()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank is noise
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
