"""Checks of ``seqpar train``'s options that need no model and no data: pure, run by the parent (or
every torchrun rank) before any process group exists, so a bad option is one clear error. Those of
the dynamic schedule (--sp-schedule, --token-budget, --cost-model) too."""

from __future__ import annotations

import importlib.util
import os

from seqpar.attention.dispatch import ONE_AXIS, STRATEGIES
from seqpar.integrations.memory.switches import CHECKPOINT_MODES
from seqpar.integrations.models import BUILTIN_MODELS
from seqpar.planner.bins import SP_SCHEDULES
from seqpar.planner.calibrate import MIN_MEASURED_BUDGET

from .config import (
    DTYPES,
    FIELDS,
    LORA_EXPORTS,
    NONFINITE,
    REPORT_TO,
    RESUME_AUTO,
    TrainConfig,
    model_overrides,
)
from .data import OVERFLOW
from .objectives import DATA_KINDS, OBJECTIVE_OPTIONS, OBJECTIVES, dpo_losses, objective_of
from .tokenizer import TRAIN_ON

EXTRAS = {"peft": "lora", "tensorboard": "logging", "wandb": "logging", "diffusers": "diffusers", "pyarrow": "data"}
"""Optional packages and the seqpar extra that installs them (pyproject.toml)."""


def require(package: str, option: str) -> None:
    """ValueError naming ``option`` and the extra to install when ``package`` is missing."""
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"{option} needs the {package} package: pip install 'seqpar[{EXTRAS[package]}]' (or pip "
                         f"install {package})")


def world_layout(cfg: TrainConfig, world: int | None = None) -> tuple[int, int, int]:
    """``(world, sp, dp)`` the job runs with (``dp = world / (sp x tp)``); ValueError naming the
    option to change."""
    for name in ("sp", "tp", "ep"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.dp is not None and cfg.dp < 1:
        raise ValueError(f"--dp must be >= 1, got {cfg.dp}")
    if world is None:
        world = cfg.nproc if cfg.nproc is not None else cfg.sp * cfg.tp * (cfg.dp or 1)
    if world < 1:
        raise ValueError(f"--nproc must be >= 1, got {world}")
    ranks = cfg.sp * cfg.tp  # the ranks that hold one batch
    what = f"--sp {cfg.sp}" + (f" x --tp {cfg.tp} = {ranks}" if cfg.tp > 1 else "")
    if world % ranks:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"{what} does not divide the world size {world}: choose "
                         f"{'--sp x --tp' if cfg.tp > 1 else '--sp'} in {divisors} or --nproc a multiple of {ranks}")
    dp = cfg.dp if cfg.dp is not None else world // ranks
    if dp * ranks != world:
        raise ValueError(f"--dp {dp} x {what} = {dp * ranks} ranks, but the world has {world}: "
                         f"use --dp {world // ranks} or omit it")
    return world, cfg.sp, dp


def check_parallelism(cfg: TrainConfig, sp: int, dp: int) -> None:
    """--tp and --ep against the other options (pure): what seqpar cannot run exactly together is
    refused by name. Raises ValueError naming the option to change."""
    if cfg.ep > 1 and (dp * sp) % cfg.ep:
        ok = [d for d in range(1, dp * sp + 1) if (dp * sp) % d == 0]
        raise ValueError(f"--ep {cfg.ep} must divide dp x sp = {dp} x {sp} = {dp * sp} (expert parallelism borrows "
                         f"its ranks from them): choose --ep in {ok}")
    if cfg.tp > 1 and cfg.ep > 1:
        raise ValueError(f"--tp {cfg.tp} with --ep {cfg.ep}: seqpar.parallelize does not compose expert parallelism "
                         "with tensor parallelism yet (each expert shard would need splitting over tp too): use "
                         "--tp 1 with --ep, or --ep 1 with --tp")
    if cfg.ep > 1 and cfg.fsdp == "on":
        raise ValueError(f"--ep {cfg.ep} shards the experts over ep ranks, which FSDP2 (seqpar.apply_fsdp) would take "
                         "for copies of one tensor: use --fsdp off or auto (the gradients are averaged by "
                         "seqpar.sync_gradients, each expert shard over its replicas)")
    if cfg.ep > 1 and cfg.dtype == "bfloat16":
        raise ValueError(f"--dtype bfloat16 trains through FSDP2's mixed precision, which --ep {cfg.ep} runs without: "
                         "use --dtype float32 (or float64)")
    layout = [f"--{n} {getattr(cfg, n)}" for n in ("tp", "ep") if getattr(cfg, n) > 1]
    if layout and cfg.sp_schedule == "dynamic":
        raise ValueError(f"--sp-schedule dynamic with {' '.join(layout)}: its bins re-cut the sp ranks, so a tp group "
                         "would split one batch (tp) and an ep group would run different numbers of forwards (ep); "
                         "use --sp-schedule static")
    if layout and cfg.lora_r:
        raise ValueError(f"--lora-r with {' '.join(layout)}: LoRA adapters on tensor-parallel layers or beside "
                         "sharded experts are not verified exact; train every weight (leave out --lora-r), or use "
                         "--tp 1 --ep 1")


def check_config(cfg: TrainConfig, world: int | None = None) -> tuple[int, int, int]:
    """Validate what needs no model or data; returns ``(world, sp, dp)``. Raises ValueError."""
    world, sp, dp = world_layout(cfg, world)
    positive = {"steps": cfg.steps, "micro_batch": cfg.micro_batch, "grad_accum": cfg.grad_accum,
                "seq_len": cfg.seq_len, "keep_checkpoints": cfg.keep_checkpoints, "loss_tile": cfg.loss_tile,
                "mlp_tile": cfg.mlp_tile}
    for name, v in positive.items():
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if cfg.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")
    for name in ("warmup", "save_every", "eval_rows"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if cfg.grad_clip < 0 or cfg.weight_decay < 0:
        raise ValueError("--grad-clip and --weight-decay must be >= 0")
    if not cfg.adam_eps > 0:
        raise ValueError(f"--adam-eps must be > 0, got {cfg.adam_eps}")
    if cfg.timeout is not None and cfg.timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {cfg.timeout}")
    if cfg.checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"unknown --checkpoint {cfg.checkpoint!r}: choose one of {list(CHECKPOINT_MODES)}")
    if cfg.strategy not in (*STRATEGIES, "auto"):
        raise ValueError(f"unknown --strategy {cfg.strategy!r}: choose one of {[*STRATEGIES, 'auto']}")
    if cfg.dtype != "auto" and cfg.dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {cfg.dtype!r}: choose one of {['auto', *DTYPES]}")
    if cfg.strategy == "hybrid" and sp < 4:
        raise ValueError(f"--strategy hybrid needs --sp >= 4 (ring x ulysses, each >= 2), got --sp {sp}: "
                         "use ulysses or ring")
    _check_fine_tuning(cfg)
    check_objective(cfg)
    if DATA_KINDS[objective_of(cfg.objective).data].model_splits:
        check_dit_options(cfg)
    check_parallelism(cfg, sp, dp)
    check_schedule(cfg, sp)
    model_overrides(cfg)
    return world, sp, dp


def check_objective(cfg: TrainConfig) -> None:
    """--objective and its options (the registry, :mod:`seqpar.train.objectives`)."""
    spec = objective_of(cfg.objective)
    given = [n for n in OBJECTIVE_OPTIONS if getattr(cfg, n) != FIELDS[n].default]
    extra = [n for n in given if n not in spec.options]
    if extra:
        takers = [o.name for o in OBJECTIVES.values() if set(extra) <= set(o.options)]
        flags = ", ".join(f"--{n.replace('_', '-')}" for n in extra)
        raise ValueError(f"{flags} does nothing for --objective {cfg.objective}: leave it out"
                         + (", or use --objective " + " / ".join(takers) if takers else ""))
    # an option the data kind's reader does not read (pairs: completions only, each sequence cut to
    # --seq-len keeping its start, as TRL)
    read = {n for kind in DATA_KINDS.values() for n in kind.options}
    moot = [f"--{n.replace('_', '-')} {getattr(cfg, n)}" for n in sorted(read - set(DATA_KINDS[spec.data].options))
            if getattr(cfg, n) != FIELDS[n].default]
    if moot:
        why = (" (pairs train on their completions, each sequence cut to --seq-len keeping its start, as TRL)"
               if spec.data == "pairs" else "")
        raise ValueError(f"{', '.join(moot)} does nothing for --objective {cfg.objective}, which trains on "
                         f"{spec.data}{why}: leave it out")
    if not cfg.beta > 0:
        raise ValueError(f"--beta must be > 0, got {cfg.beta}")
    dpo_losses(cfg)
    if cfg.kl_coef < 0 or not cfg.clip_epsilon > 0 or (cfg.clip_epsilon_high is not None and
                                                        not cfg.clip_epsilon_high > 0):
        raise ValueError("--kl-coef must be >= 0, --clip-epsilon and --clip-epsilon-high > 0")
    if cfg.rl_loss == "dr_grpo" and cfg.objective == "grpo" and not cfg.max_completion_length:
        raise ValueError("--rl-loss dr_grpo divides each completion's token sum by --max-completion-length: set it "
                         "(TRL's max_completion_length, the generation's limit)")
    if spec.scores and cfg.lora_r:
        raise ValueError(f"--objective {cfg.objective} trains a new score head, which --lora-r would leave frozen "
                         "(LoRA adapts the linear layers of the body): leave out --lora-r")
    if spec.scores and cfg.fsdp == "on" and cfg.model not in BUILTIN_MODELS:
        raise ValueError(f"--objective {cfg.objective} from a checkpoint builds the model's new score head on "
                         "every rank, which FSDP2's sharded loading does not do yet: use --fsdp off or a built-in "
                         "--model")


DIT_MOOT = {
    "packing": "a sample is one clip: there are no documents to pack",
    "chat_template": "the data is latents and text embeddings: there is no text to template",
    "tokenizer": "the data is latents and text embeddings: there is no text to tokenize",
    "tiled_loss": "a DiT has no vocabulary head to tile (its flow loss is per element already)",
    "loss_tile": "a DiT has no vocabulary head to tile (its flow loss is per element already)",
    "plan": "seqpar plan lays out causal LMs; give --sp (and --strategy) yourself",
    "gpu_memory": "it sizes --plan auto, which lays out causal LMs",
}
"""Options that do not apply to a diffusers DiT (--objective flow-matching), and why."""


def check_dit_options(cfg: TrainConfig) -> None:
    """--objective flow-matching's model is a diffusers DiT: the options that do not apply to it are
    refused by name (pure). Raises ValueError naming the option."""
    require("diffusers", "--objective flow-matching")
    if any(str(p).lower().endswith(".parquet") for p in cfg.data or ()):
        require("pyarrow", "--data *.parquet")
    given = [n for n in DIT_MOOT if getattr(cfg, n) != FIELDS[n].default]
    if given:
        name = given[0]
        flag = f"--{'no-' if getattr(cfg, name) is False else ''}{name.replace('_', '-')}"
        raise ValueError(f"{flag} does not apply to --objective flow-matching: {DIT_MOOT[name]}; leave it out")
    layout = [f"--{n} {getattr(cfg, n)}" for n in ("tp", "ep") if getattr(cfg, n) > 1]
    if layout:
        raise ValueError(f"{' '.join(layout)}: a diffusers transformer runs sequence parallelism alone (seqpar "
                         "refuses a DiT over a tp or ep mesh): use --sp and dp")
    if cfg.fsdp == "on" or cfg.dtype == "bfloat16":
        what = "--fsdp on" if cfg.fsdp == "on" else "--dtype bfloat16 (FSDP2's mixed precision)"
        raise ValueError(f"{what}: --objective flow-matching trains its DiT without FSDP2 (every rank holds the "
                         "whole model; its gradients by seqpar.sync_gradients): use --fsdp off or auto and --dtype "
                         "float32 or float64")
    if cfg.lora_r and cfg.lora_export == "adapter":
        raise ValueError("--lora-export adapter: a diffusers DiT is exported with its LoRA adapters merged into the "
                         "weights (from_pretrained loads it): leave it out")


def _check_fine_tuning(cfg: TrainConfig) -> None:
    """Files, LoRA, evaluation and logging options."""
    for name, value, choices in (("train-on", cfg.train_on, TRAIN_ON), ("overflow", cfg.overflow, OVERFLOW),
                                 ("report-to", cfg.report_to, REPORT_TO), ("lora-export", cfg.lora_export,
                                                                          LORA_EXPORTS)):
        if value not in choices:
            raise ValueError(f"unknown --{name} {value!r}: choose one of {list(choices)}")
    if cfg.eval_every < 0:
        raise ValueError(f"--eval-every must be >= 0, got {cfg.eval_every}")
    if cfg.resume not in (False, True, RESUME_AUTO):
        raise ValueError(f"--resume takes no value or {RESUME_AUTO!r}, got {cfg.resume!r}")
    if cfg.resume and cfg.overwrite:
        raise ValueError("--resume continues the run in --save-dir and --overwrite deletes it: choose one")
    if cfg.resume_fallback and not cfg.resume:
        raise ValueError("--resume-fallback chooses the checkpoint --resume continues from: give --resume too")
    if cfg.on_nonfinite not in NONFINITE:
        raise ValueError(f"unknown --on-nonfinite {cfg.on_nonfinite!r}: choose one of {list(NONFINITE)}")
    for name, path, kind in (("tokenizer", cfg.tokenizer, os.path.isdir), ("chat-template", cfg.chat_template,
                                                                          os.path.isfile)):
        if path and not kind(path):
            raise ValueError(f"--{name} {path!r}: no such {'directory' if kind is os.path.isdir else 'file'}")
    if cfg.lora_r < 0:
        raise ValueError(f"--lora-r must be >= 0 (0: no LoRA), got {cfg.lora_r}")
    if not cfg.lora_r:
        given = [n for n, v in (("--lora-alpha", cfg.lora_alpha), ("--lora-targets", cfg.lora_targets),
                                ("--lora-export adapter", cfg.lora_export == "adapter" or None)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} without --lora-r: set --lora-r R to train LoRA adapters")
    else:
        require("peft", "--lora-r")
        if cfg.lora_alpha is not None and cfg.lora_alpha <= 0:
            raise ValueError(f"--lora-alpha must be > 0, got {cfg.lora_alpha}")
        if cfg.lora_targets is not None and not cfg.lora_targets:
            raise ValueError("--lora-targets needs at least one module name (or leave it out: all-linear)")
    if cfg.report_to != "none":
        require(cfg.report_to, f"--report-to {cfg.report_to}")


def check_schedule(cfg: TrainConfig, sp: int) -> None:
    """--sp-schedule and --token-budget against the other options (pure). Raises ValueError naming
    the option to change."""
    if cfg.sp_schedule not in SP_SCHEDULES:
        raise ValueError(f"unknown --sp-schedule {cfg.sp_schedule!r}: choose one of {list(SP_SCHEDULES)}")
    if cfg.sp_schedule == "static":
        if cfg.token_budget is not None:
            raise ValueError("--token-budget forms the steps of a dynamic schedule: give --sp-schedule dynamic too")
        if cfg.cost_model != "measure":
            raise ValueError("--cost-model chooses a dynamic schedule's cost model: give --sp-schedule dynamic too")
        return
    check_dynamic_objective(cfg)
    budget = cfg.token_budget if cfg.token_budget is not None else -(-unit_tokens(cfg) // sp)
    if cfg.cost_model == "measure" and budget < MIN_MEASURED_BUDGET:
        raise ValueError(f"--cost-model measure times bins of up to 16 documents per rank, which {budget} tokens per "
                         f"rank (--token-budget, or --seq-len / --sp) cannot hold: use --cost-model builtin or a "
                         f"budget of >= {MIN_MEASURED_BUDGET}")
    if cfg.strategy not in ONE_AXIS:
        raise ValueError(f"--sp-schedule dynamic runs bins at degrees below --sp on sub-groups of ranks, which "
                         f"--strategy {cfg.strategy} has none of: use --strategy {' or '.join(ONE_AXIS)}")
    if cfg.token_budget is not None:
        if cfg.token_budget < 1:
            raise ValueError(f"--token-budget must be >= 1, got {cfg.token_budget}")
        if cfg.micro_batch != 1:
            raise ValueError("--token-budget sets how many rows a step holds, in place of --micro-batch: leave "
                             "--micro-batch at 1")
        need = -(-unit_tokens(cfg) // sp)
        if cfg.token_budget < need:
            what = f"a row of --seq-len {cfg.seq_len}" if unit_tokens(cfg) == cfg.seq_len else \
                f"a pair of two rows of --seq-len {cfg.seq_len}"
            raise ValueError(f"--token-budget {cfg.token_budget} cannot hold {what} on --sp {sp} ranks: use "
                             f"--token-budget >= {need}")


def check_dynamic_objective(cfg: TrainConfig) -> None:
    """--objective under --sp-schedule dynamic (pure): a bin holds whole pairs, and the loss is a sum
    of per-unit terms over the step's units, so it is exact when each unit's term depends on that unit
    alone. Raises ValueError naming the option for an objective whose loss couples a batch's units."""
    problem = objective_of(cfg.objective).dynamic_problem(cfg)
    if problem is not None:
        raise ValueError(problem)


def unit_tokens(cfg: TrainConfig) -> int:
    """The most real tokens of one unit of the data order: a row of --seq-len, or a pair of two such
    rows (preference data without --packing: chosen and rejected, one bin holds both)."""
    return 2 * cfg.seq_len if objective_of(cfg.objective).data == "pairs" and not cfg.packing else cfg.seq_len
