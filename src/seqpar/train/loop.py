"""The training step of ``seqpar train``: model, data, optimizer and mesh of one rank.

Per optimizer step, on every rank::

    rows      this dp rank's micro-batches (rows k = f(seed, step, micro, dp rank): resumable)
    N         the step's units, all dp ranks: targets (sft) or pairs (dpo, reward, ...; .objective_step)
    for each micro-batch:
      local = seqpar.shard_batch(batch, mesh)               this SP rank's slice
      objective(model, local, mesh, ...).loss.backward()    exact share of the global mean over N
    seqpar.sync_gradients (or FSDP2's reduce-scatter): the dp x sp average, every grad now exact
    the global gradient norm (and the step's loss): NaN / Inf stops or skips the step (--on-nonfinite)
    clip to the global norm, AdamW, warmup + cosine

so the loss and gradients are those of one big batch on one device, whatever dp, sp, grad_accum.
"""

from __future__ import annotations

import math
import os
import resource
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import seqpar
from seqpar.batch.loss import token_losses
from seqpar.comm import collectives, faults
from seqpar.comm.mesh import axis_group, default_device_type
from seqpar.integrations.distributed.materialize import load_full_state_dict, materialize
from seqpar.integrations.models import BUILTIN_MODELS

from .config import DTYPES, TrainConfig, builtin_fields, memory_options, resolve_dtype
from .data import row_index, stack
from .demo_data import EVAL, IGNORE, answer_accuracy
from .dynamic import dynamic_steps
from .job import Job, make_data
from .lora import add_lora, count_params, init_lora, with_lora_names
from .objective_step import ObjectiveStep, objective_meta_model, objective_model
from .report import EvalResult
from .tokenizer import load_hf_tokenizer


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


def use_fsdp(cfg: TrainConfig, device_type: str, dtype: str) -> bool:
    """FSDP2 when asked, and by default with CUDA or bfloat16 (``dtype``: the resolved --dtype; its
    mixed precision keeps fp32 master weights; autocast would hand attention q/k in fp32 and v in
    bf16)."""
    return cfg.fsdp == "on" or (cfg.fsdp == "auto" and (device_type == "cuda" or dtype == "bfloat16"))


def fsdp_options(cfg: TrainConfig, dtype: torch.dtype) -> dict[str, Any]:
    """``fully_shard``'s keywords for the run. bfloat16: bf16 compute, fp32 master weights and
    gradient reduction (the same policy for either --sp-schedule). A dynamic schedule keeps each
    block's parameters gathered from its first forward of a micro-step to the flush pass
    (``reshard_after_forward=False``): ranks run different numbers of bins, so an all-gather per
    bin's backward, over every rank, would wait on ranks that have no such bin (a hang); the price
    is the whole model's parameters held per rank during the step, as without FSDP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kw: dict[str, Any] = {}
    if dtype == torch.bfloat16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.sp_schedule == "dynamic":
        kw["reshard_after_forward"] = False
    return kw


def lr_lambda(cfg: TrainConfig):
    """Linear warmup to 1 over ``warmup`` steps, then cosine down to ``min_lr_ratio``."""
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return f


class Trainer:
    """Model, data, optimizer and mesh of one rank. Needs an initialized process group.

    The model is built on the meta device, parallelized, sharded (FSDP2) and only then given its
    weights (:mod:`seqpar.integrations.distributed.materialize`): a built-in's initialisation is drawn module by
    module, this rank keeping its shard -- the same bits as the unsharded model's for the seed, on
    any number of ranks; a checkpoint (``--model PATH``) is read by rank 0 alone and broadcast tensor
    by tensor. So no rank > 0 ever holds the whole model. Without FSDP every rank keeps a full
    replica (plain gradient sync needs one): the built-in is initialized the same way, in place on
    the device; a checkpoint is read by every rank. With ``--lora-r`` peft's adapters go into the
    model before it is parallelized and sharded, the base frozen; their initial values are drawn
    the same on every rank (:mod:`.lora`), and only they are given to the optimizer.
    """

    def __init__(self, job: Job) -> None:
        cfg = self.cfg = job.cfg
        self.job = job
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != job.world:
            raise ValueError(f"the job was prepared for {job.world} ranks but runs on {self.world}")
        self.device = torch.device("cpu")
        if torch.cuda.is_available() and default_device_type() == "cuda":  # NCCL among the group's backends
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        self.mesh = seqpar.init_mesh(**job.mesh_kwargs, device_type=self.device.type)
        self.dp_rank = dist.get_rank(axis_group(self.mesh, "dp"))
        self.sp_rank = dist.get_rank(axis_group(self.mesh, "sp"))  # hybrid: the flattened ring x ulysses axis

        self.dtype = resolve_dtype(cfg, self.device.type)
        dtype = DTYPES[self.dtype]
        param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.use_fsdp = use_fsdp(cfg, self.device.type, self.dtype)
        model, full_state = self._build_model(param_dtype)  # on the meta device (a replica: already loaded)
        self.peft = None  # --lora-r: the PeftModel around `model` (its adapters are inside `model`)
        if cfg.lora_r:
            self.peft = add_lora(model, cfg)
            if full_state is not None:  # rank 0's checkpoint, under the adapted layers' names
                full_state = with_lora_names(model, full_state, cfg.seed)
        self.n_params, self.n_trainable = count_params(model)
        seqpar.parallelize(self.peft or model, self.mesh, strategy=job.strategy)
        memory = memory_options(cfg, self.device.type)
        if memory is not None:  # a ValueError here (a head or MLP it cannot tile) is the same on every rank
            seqpar.reduce_memory(model, self.mesh, **memory)
        self.tiled_loss = cfg.tiled_loss
        if self.use_fsdp:
            seqpar.apply_fsdp(model, self.mesh, **fsdp_options(cfg, dtype))  # over every dp x sp rank, averaging
        if cfg.model in BUILTIN_MODELS:
            torch.manual_seed(cfg.seed)  # the same initial weights on every rank, whatever the sharding
            materialize(model, self.device)
        elif self.use_fsdp:
            materialize(model, self.device, params=False)  # buffers (RoPE); the weights come from rank 0
            load_full_state_dict(model, full_state)  # with the adapters' initial values (LoRA)
        if self.peft is not None and not (self.use_fsdp and cfg.model not in BUILTIN_MODELS):
            init_lora(model, cfg.seed)  # the same adapters on every rank, whatever the sharding
        full_state = None
        self.attention = seqpar.attention_kernel(model)  # the kernel "auto" chose, in words
        self.model = model
        self.objective = ObjectiveStep(self)  # --objective: the loss, its reference and its unit count
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                           betas=(0.9, 0.95), weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.step = 0
        self.dynamic = dynamic_steps(self)  # --sp-schedule dynamic (None: static)

    def _build_model(self, param_dtype: torch.dtype) -> tuple[torch.nn.Module, dict[str, Tensor] | None]:
        """``(model, full state dict or None)``; sets ``self.data``. A built-in, and a checkpoint
        under FSDP, come on the meta device (rank 0 also returns the checkpoint's weights, on the
        CPU); a checkpoint without FSDP is loaded whole on this rank's device."""
        cfg = self.cfg
        # the run's tokenizer (None: bytes, or the copy task), kept for the export
        self.tokenizer = load_hf_tokenizer(cfg.model, cfg.tokenizer, cfg.chat_template)
        self.data = self.job.data if self.job.data is not None else make_data(cfg, self.tokenizer)
        if cfg.model in BUILTIN_MODELS:
            with torch.device("meta"):
                model = objective_model(cfg, self.tokenizer, dtype=param_dtype,
                                        **builtin_fields(cfg, self.data.vocab_size))
            return model, None
        state = None
        if not self.use_fsdp:
            model = objective_model(cfg, self.tokenizer, dtype=param_dtype)
            model.to(self.device)
        else:
            model = objective_meta_model(cfg, dtype=param_dtype)  # first: a refusal comes before any loading
            if self.rank == 0:  # the only rank that reads the weights
                full = objective_model(cfg, self.tokenizer, dtype=param_dtype)
                state = full.state_dict()
                del full
        vocab = int(model.get_input_embeddings().num_embeddings)
        if self.data.max_token_id >= vocab:  # prepare_job checked it; a job prepared elsewhere may not have
            raise ValueError(f"the data uses token ids up to {self.data.max_token_id} but --model {cfg.model!r} "
                             f"embeds {vocab}: give the checkpoint its tokenizer or use a built-in model")
        return model, state

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
        """Gradients of the global mean loss of ``step`` (over its targets, or its pairs) on every rank
        (complete and exact after this: averaged over dp x sp). Returns ``(this dp rank's share of the
        loss, units)``."""
        if self.dynamic is not None:
            return self.dynamic.forward_backward(step)
        batches = self.micro_batches(step)
        n_items = self.objective.count(batches)
        share = 0.0
        for i, b in enumerate(batches):
            if self.use_fsdp:  # reduce-scatter once per step, after the last micro-batch, not after each
                self.model.set_requires_gradient_sync(i == len(batches) - 1)
            loss, _ = self.objective.loss(b, n_items)
            with faults.publishing("the backward"):  # an exception here is told to every rank
                loss.backward()
            share += float(loss.detach())
        if not self.use_fsdp:
            seqpar.sync_gradients(self.model, self.mesh)
        self.objective.finish_step()  # its metrics over every pair of the step (every dp rank's)
        return share, int(n_items)

    def grad_norm(self) -> tuple[Tensor, float]:
        """The global gradient norm (the same on every rank), as a tensor and a number: after
        sync_gradients every rank holds the complete gradients, so the local norm is the global one;
        under FSDP the norm of the sharded (DTensor) gradients is reduced by torch (a DTensor then,
        which :meth:`optimizer_step` clips with)."""
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        return norm, float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def optimizer_step(self, norm: tuple[Tensor, float] | None = None) -> float:
        """Clip to the global gradient norm (``norm``: :meth:`grad_norm`'s, computed if not given),
        step AdamW and the schedule; returns the norm."""
        tensor, value = self.grad_norm() if norm is None else norm
        if self.cfg.grad_clip > 0:  # what clip_grad_norm_ does, with the norm already in hand
            torch.nn.utils.clip_grads_with_norm_([p for p in self.model.parameters() if p.grad is not None],
                                                 self.cfg.grad_clip, tensor)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return value

    def skip_step(self) -> None:
        """--on-nonfinite skip: drop the step's gradients without an update; the schedule moves on."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1

    # ----------------------------------------------------------------------------------------
    # evaluation
    # ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> EvalResult | None:
        """Held-out loss and greedy accuracy over the targets of the held-out rows (all ranks)."""
        if self.objective.paired:  # held-out pairs: loss and preference accuracy
            return self.objective.evaluate()
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
            if self.tiled_loss:  # the same tiles as training: no [S_local, V] logits
                stats = seqpar.token_stats(self.model, local)
                row = torch.stack([t.sum().double() for t in (stats.losses, stats.correct & stats.valid, stats.valid)])
            else:
                targets = local.pop("labels")
                local.pop("shift_labels", None)
                logits = self.model(**local).logits
                correct, count = answer_accuracy(logits, targets)
                row = torch.tensor([float(token_losses(logits, targets, IGNORE).sum()), correct, count],
                                   dtype=torch.float64)
            if i < len(mine):  # else a padding round of a dp rank with fewer rows
                totals += row.to(totals)
        self.model.train()
        collectives.all_reduce(totals)  # fault-aware: a peer failing in its evaluation ends this wait
        loss_sum, correct, count = totals.tolist()
        return EvalResult(loss=loss_sum / max(count, 1), accuracy=correct / max(count, 1), targets=int(count))
