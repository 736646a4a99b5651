"""Every option of ``seqpar train`` in one place: defaults, help text, config files, validation.

The same names serve the command line (``--seq-len``), config files (``seq_len:`` or ``seq-len =``
in YAML / TOML) and the Python API (``TrainConfig(seq_len=...)``). Precedence: built-in default <
config file < command line. :func:`check_config` is pure (no processes, no collectives) so the
parent rejects bad options before any worker starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from seqpar.attention.dispatch import STRATEGIES
from seqpar.batch.tiles import DEFAULT_LOSS_TILE, MAX_MLP_TILE, MIN_TILE
from seqpar.integrations.memory.switches import CHECKPOINT_MODES
from seqpar.integrations.models import BUILTIN_MODELS
from seqpar.objectives import AGGREGATIONS, DPO_LOSSES, WEIGHTINGS
from seqpar.objectives.advantages import SCALE_REWARDS
from seqpar.planner.bins import SP_SCHEDULES

from .data import OVERFLOW
from .formats import FORMATS_HELP
from .objectives import DATA_KINDS, OBJECTIVES
from .rollout_data import ADVANTAGE_ESTIMATORS
from .tokenizer import TRAIN_ON

REPORT_TO = ("none", "tensorboard", "wandb")
NONFINITE = ("stop", "skip")
RESUME_AUTO = "auto"
LORA_EXPORTS = ("merged", "adapter")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
"""--dtype names and the torch dtypes they stand for (the one table; bench uses it too)."""

# The model `seqpar train` builds when --model is a built-in name: the built-in family (tiny-llama by
# default) at a size that learns the embedded task in a few CPU minutes. Vocabulary and maximum
# position come from the data (task or tokenizer) and --seq-len. A RoPE base of 1000 (instead of
# 10000) lets attention find the copy task's long offset early (README: "What seqpar train does").
TRAIN_SIZE: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                  rope_theta=1000.0)
SIZED_FOR_TRAIN = ("tiny-llama", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-qwen3-moe")
"""Built-ins that :data:`TRAIN_SIZE` resizes; ``small-llama3`` keeps its realistic shape (issue 11)."""

CPU_TIMEOUT, CUDA_TIMEOUT = 300.0, 1800.0
"""Default --timeout: gloo on the CPU fails fast; under NCCL a rank may wait for rank 0 reading a large
checkpoint (sharded loading) or writing one, and steps at 1M tokens take minutes."""


def _opt(default: Any, help: str, **kw: Any) -> Any:
    """A field with its --help text; ``shown`` says the default in words where the value would not. A
    bool that is on by default is a switch with its --no- form (``--no-plot``); one off by default is
    a plain flag."""
    if default is True:
        kw.setdefault("negatable", True)
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """Options of ``seqpar train`` (see ``seqpar train --help``)."""

    model: str = _opt("tiny-llama", f"a built-in config name ({', '.join(BUILTIN_MODELS)}; "
                      f"{', '.join(SIZED_FOR_TRAIN)} at a training size; any field by --model-config) or a local "
                      "transformers checkpoint directory (its weights, config and tokenizer)")
    model_config: str = _opt("", "JSON object of config fields for a built-in model, applied over the training "
                             f"size {json.dumps(TRAIN_SIZE)}", metavar="JSON", shown="{}")
    tokenizer: str = _opt("", "a transformers tokenizer directory to read --data with", metavar="DIR",
                          shown="the --model checkpoint's own; bytes for a built-in model")
    data: list[str] | None = _opt(None, f"data files, read by what they are: {FORMATS_HELP}", nargs="+",
                                  metavar="FILE", shown="none: the embedded long-range copy task")
    text_field: str = _opt("text", "the JSONL field / dataset column that holds plain text")
    train_on: str = _opt("responses", "which tokens carry the loss in chat and prompt/completion data: responses "
                         "(the assistant turns -- the tokens inside the chat template's {% generation %} markers -- "
                         "and the completion, as SFT frameworks do) or all (every token)", choices=TRAIN_ON)
    chat_template: str = _opt("", "a Jinja chat template file used instead of the tokenizer's own", metavar="FILE",
                              shown="the tokenizer's")
    overflow: str = _opt("auto", "documents longer than --seq-len: split (the rest goes on in the next row; packed "
                         "documents flow across row edges), truncate (the rest is dropped; packed documents never "
                         "cross a row edge) or auto (split plain text, truncate chat and prompt/completion data); the "
                         "run says what it did", choices=OVERFLOW)
    seq_len: int = _opt(4096, "tokens per row (the sequence every SP group shares)")
    packing: bool = _opt(False, "pack several documents per row (position ids restart, no attention across "
                         "documents) instead of one padded document per row")
    sp: int = _opt(2, "sequence-parallel degree: ranks that share one sequence")
    dp: int | None = _opt(None, "data-parallel degree", shown="world size / (sp x tp)")
    tp: int = _opt(1, "tensor-parallel degree: ranks that split each layer's heads and MLP columns and the "
                   "vocabulary by the model's own plan (transformers' tp_plan; innermost: keep it inside a host); "
                   "a tp group reads the same rows")
    ep: int = _opt(1, "expert-parallel degree of an MoE model: ranks of dp x sp that split every MoE layer's experts "
                   "(folded over them, no ranks of its own); must divide dp x sp; without FSDP2 (gradients by "
                   "sync_gradients)")
    plan: str = _opt("none", "auto: take seqpar plan's layout for the job's ranks and model (--sp, --tp, --ep, dp, "
                     "the strategy, FSDP2 and the memory switches; said at the start with why); none: the options as "
                     "given", choices=("none", "auto"))
    gpu_memory: str | None = _opt(None, "--plan auto: the memory of one rank's device the plan must fit, e.g. 80GB",
                                  metavar="SIZE", shown="the CUDA device's total memory; on the CPU the host's "
                                  "memory / the local ranks")
    strategy: str = _opt("ulysses", "sequence-parallel attention: ulysses, ring, hybrid (ring x ulysses) or auto "
                         "(seqpar.plan picks)", choices=(*STRATEGIES, "auto"))
    sp_schedule: str = _opt("static", "static (every row over all --sp ranks) or dynamic (each step's rows binned, "
                            "each bin at the SP degree its longest row needs -- 1, 2, 4, ... --sp -- on sub-groups of "
                            "ranks; padding dropped; exact as static; under FSDP2 each rank keeps the parameters "
                            "gathered for the step)", choices=SP_SCHEDULES)
    token_budget: int | None = _opt(None, "with --sp-schedule dynamic: tokens per rank per step; a step (and each "
                                    "--grad-accum micro-step) holds as many rows as fit it, in place of --micro-batch",
                                    shown="--seq-len / --sp, with the static schedule's rows per step")
    cost_model: str = _opt("measure", "with --sp-schedule dynamic: the cost model its bins are balanced with: "
                           "measure (refitted at the start from the model's own bins on these ranks, a few seconds) "
                           "or builtin (a fixed guess per device type: the same schedules every run)",
                           choices=("measure", "builtin"))
    steps: int = _opt(300, "optimizer steps")
    lr: float = _opt(1e-2, "peak learning rate (AdamW)")
    warmup: int = _opt(30, "linear warmup steps, then cosine decay to --min-lr-ratio x lr")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of --lr")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    adam_eps: float = _opt(1e-8, "AdamW epsilon (added to the root of the second moment)")
    grad_clip: float = _opt(1.0, "clip the global gradient norm to this (0: no clipping)")
    micro_batch: int = _opt(1, "rows per rank per forward (one dp rank's rows; its SP ranks share them)")
    grad_accum: int = _opt(1, "micro-batches per optimizer step")
    dtype: str = _opt("auto", "compute dtype: float32, bfloat16 (FSDP2 mixed precision, fp32 master weights), "
                      "float64, or auto (bfloat16 on CUDA, float32 on the CPU)",
                      choices=("auto", *DTYPES))
    save_dir: str = _opt(os.path.join("runs", "seqpar-train"), "where metrics.jsonl, summary.json, loss.png and "
                         "checkpoints/ go; a fresh run refuses a save dir that holds checkpoints (--resume or "
                         "--overwrite)")
    save_every: int = _opt(100, "checkpoint every N steps (and always at the end); 0: only at the end")
    keep_checkpoints: int = _opt(2, "how many of the latest checkpoints to keep")
    resume: bool | str = _opt(False, "continue from the latest complete checkpoint in --save-dir (same loss curve); "
                              "--resume auto: continue if there is one, else start afresh (for torchrun "
                              "--max-restarts); a damaged checkpoint is refused, naming the file",
                              shown="off")
    resume_fallback: bool = _opt(False, "with --resume: if the latest checkpoint is damaged (a truncated or corrupt "
                                 "file), continue from the newest complete one before it instead of refusing")
    on_nonfinite: str = _opt("stop", "a NaN / Inf loss or gradient norm: stop (every rank, at that step, naming the "
                             "last good checkpoint) or skip (no update for that step; the run goes on)",
                             choices=NONFINITE)
    overwrite: bool = _opt(False, "start afresh in a --save-dir that holds an earlier run's checkpoints, deleting them")
    seed: int = _opt(2, "seed of the model init and the data order")
    eval_rows: int = _opt(8, "held-out rows for evaluation (task accuracy / loss); --data: at most a tenth of the "
                          "rows, the rest train")
    eval_every: int = _opt(20, "evaluate on the held-out rows every N steps (0: before and after training only); "
                           "every evaluation is a line of metrics.jsonl")
    report_to: str = _opt("none", "also log the metrics to tensorboard (<save-dir>/tensorboard) or wandb (into "
                          "<save-dir>/wandb; offline unless wandb is logged in or WANDB_MODE says otherwise); needs "
                          "pip install 'seqpar[logging]'", choices=REPORT_TO)
    plot: bool = _opt(True, "write <save-dir>/loss.png at the end: the train and eval loss curves; --objective "
                      "flow-matching also samples clips and writes samples.png (--no-plot: neither)")
    lora_r: int = _opt(0, "train LoRA adapters of this rank instead of every weight (0: full fine-tuning); needs "
                        "pip install 'seqpar[lora]'")
    lora_alpha: float | None = _opt(None, "LoRA scale numerator: adapters scaled by alpha / r", shown="2 x --lora-r")
    lora_targets: list[str] | None = _opt(None, "module names LoRA adapts (peft's target_modules)", nargs="+",
                                          metavar="NAME", shown="all-linear: every linear layer but the output head")
    export_hf: bool = _opt(False, "at the end, write <save-dir>/hf: save_pretrained output (safetensors, config, "
                           "tokenizer) that AutoModelForCausalLM.from_pretrained loads; or later: seqpar export")
    lora_export: str = _opt("merged", "what a LoRA run exports: merged (adapters folded into the weights, a plain "
                            "transformers model) or adapter (peft's adapter files)", choices=LORA_EXPORTS)
    fsdp: str = _opt("auto", "FSDP2 over the dp x sp ranks: on, off, or auto (on with CUDA or bfloat16)",
                     choices=("auto", "on", "off"))
    tiled_loss: bool = _opt(True, "the loss from the final hidden states in tiles of --loss-tile tokens: no "
                            "[seq, vocab] logits at once, in training and in the final evaluation "
                            "(--no-tiled-loss: the model's own head and loss)")
    tiled_mlp: bool = _opt(True, "each decoder layer's MLP in sequence tiles (--mlp-tile), recomputed in backward "
                           "(--no-tiled-mlp: whole)")
    checkpoint: str = _opt("layers", "activation checkpoints: none, layers (each decoder layer recomputed in "
                           "backward) or offload (layers, with each layer's input parked in pinned host memory; "
                           "the same as layers on the CPU)", choices=CHECKPOINT_MODES)
    loss_tile: int = _opt(DEFAULT_LOSS_TILE, "tokens per tile of the tiled loss")
    mlp_tile: int | None = _opt(None, "tokens per tile of the tiled MLP", shown="tiles following the shard: a tile's "
                                f"[tile, intermediate] within the shard's [tokens, hidden], {MIN_TILE} to "
                                f"{MAX_MLP_TILE} tokens")
    nproc: int | None = _opt(None, "local worker processes when not under torchrun", shown="sp x tp x dp, or sp x tp")
    timeout: float | None = _opt(None, "seconds a collective may wait before the job counts as hung: the process "
                                 "group's timeout (NCCL's watchdog), which must outlast the longest wait of one rank "
                                 "for another -- rank 0 reading a checkpoint, a checkpoint save, the first step",
                                 shown=f"{CPU_TIMEOUT:.0f} on the CPU, {CUDA_TIMEOUT:.0f} with CUDA")
    progress: bool = _opt(True, "progress bar on rank 0 (--no-progress to turn it off)")
    # --- the objective (seqpar.train.objectives) ---
    objective: str = _opt("sft", "what the run trains: " + "; ".join(f"{o.name} ({o.summary})" for o in
                          OBJECTIVES.values()) + "; the preference objectives train on --data with prompt / chosen / "
                          "rejected, and without --data learn the embedded preference demo" + "".join(
                              f"; {o.name} runs with " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                  o.defaults.items()) + " unless given"
                              for o in OBJECTIVES.values() if o.defaults), choices=tuple(OBJECTIVES))
    beta: float = _opt(0.1, "--objective dpo / simpo / orpo / kto: the beta of the loss (TRL's)",
                       shown="0.1 (TRL's DPO and KTO)")
    kto_loss: str = _opt("kto", "--objective kto: the loss type, TRL's: kto (with the KL term) or apo_zero_unpaired",
                         choices=("kto", "apo_zero_unpaired"))
    # --- RL on rollouts (--objective grpo / ppo: seqpar.train.rollout_data) ---
    rl_loss: str = _opt("dapo", "--objective grpo: how the clipped per-token losses add up (TRL's loss_type): grpo "
                        "(each completion's token mean, then the mean over completions), dr_grpo (token sums over "
                        "completions x --max-completion-length), bnpo (the token mean of each micro-batch), dapo (the "
                        "token mean over the whole step)", choices=tuple(AGGREGATIONS))
    kl_coef: float = _opt(0.0, "--objective grpo / ppo: the KL-to-the-reference term's coefficient (TRL's beta; k3 "
                          "estimator); the reference log-probs come from the rollouts' ref_logps, or else a frozen "
                          "copy of the initial model (the model with its adapters off with --lora-r)")
    clip_epsilon: float = _opt(0.2, "--objective grpo / ppo: the ratio's clip range below 1 (and above, unless "
                               "--clip-epsilon-high)")
    clip_epsilon_high: float | None = _opt(None, "--objective grpo / ppo: the ratio's clip range above 1 (DAPO's "
                                           "clip-higher)", shown="--clip-epsilon")
    max_completion_length: int | None = _opt(None, "--rl-loss dr_grpo: the constant each completion's token sum is "
                                             "divided by (TRL's max_completion_length)",
                                             shown="none (needed by dr_grpo)")
    advantages: str = _opt("grpo", "--objective grpo on rewards: the advantage estimator per prompt group: grpo (the "
                           "group's mean and std) or rloo (leave-one-out)", choices=ADVANTAGE_ESTIMATORS)
    scale_rewards: str = _opt("group", "--advantages grpo: divide by the std of the group, of the batch, or none "
                              "(Dr. GRPO)", choices=SCALE_REWARDS)
    dpo_loss: str = _opt("sigmoid", f"--objective dpo: the loss type, TRL's ({', '.join(DPO_LOSSES)}); several joined "
                         "by commas add up")
    # --- rectified flow (--objective flow-matching: seqpar.objectives.flow_matching) ---
    flow_weighting: str = _opt("none", "--objective flow-matching: SD3's loss weighting per sample at timestep t: "
                               "none, sigma_sqrt (1 / t^2) or cosmap (2 / (pi (1 - 2t + 2t^2)))", choices=WEIGHTINGS)
    logit_mean: float = _opt(0.0, "--objective flow-matching: the mean of the logit-normal timesteps, "
                             "t = sigmoid(mean + std * N(0, 1)) (SD3's logit_mean)")
    logit_std: float = _opt(1.0, "--objective flow-matching: the std of the logit-normal timesteps (SD3's logit_std)")

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
OPTIONAL_KINDS: dict[str, type] = {"data": list, "dp": int, "nproc": int, "timeout": float, "lora_alpha": float,
                                   "gpu_memory": str, "lora_targets": list, "token_budget": int, "mlp_tile": int,
                                   "clip_epsilon_high": float, "max_completion_length": int}
"""The type of each option whose default is None (the others: their default's type)."""


def load_config_file(path: str) -> dict[str, Any]:
    """Options from a YAML (.yaml / .yml) or TOML (.toml) file: a flat mapping of option names
    (``seq_len`` or ``seq-len``). Raises ValueError naming the file and the bad key or value."""
    if not os.path.isfile(path):
        raise ValueError(f"--config {path!r}: no such file")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext in (".yaml", ".yml"):
            import yaml

            with open(path) as f:
                raw = yaml.safe_load(f)
        elif ext == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        else:
            raise ValueError(f"--config {path!r}: use a .yaml, .yml or .toml file")
    except ValueError:
        raise
    except Exception as e:  # the parsers' own error types; their message says where
        raise ValueError(f"--config {path!r} is not valid {ext[1:].upper()}: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of option names to values")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS or name == "config":
            raise ValueError(f"--config {path!r}: unknown option {key!r}; options: "
                             f"{', '.join(sorted(n.replace('_', '-') for n in FIELDS))}")
        out[name] = _coerce(name, value, f"--config {path!r}")
    return out


def _coerce(name: str, value: Any, where: str) -> Any:
    """A config-file value as the field's type (ints, floats, bools, strings, a list of files)."""
    default = FIELDS[name].default
    kind = OPTIONAL_KINDS.get(name, type(default))
    bad = ValueError(f"{where}: {name.replace('_', '-')} = {value!r} should be {kind.__name__}")
    if name == "resume" and value == RESUME_AUTO:
        return value
    if kind is list:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad
        return list(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if kind is str:
        if name == "model_config" and isinstance(value, dict):
            return json.dumps(value)
        if not isinstance(value, str):
            raise bad
        return value
    return value


def model_overrides(cfg: TrainConfig) -> dict[str, Any]:
    """Config fields for a built-in model: :data:`TRAIN_SIZE` updated by ``--model-config``."""
    extra: dict[str, Any] = {}
    if cfg.model_config:
        try:
            extra = json.loads(cfg.model_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--model-config must be a JSON object, e.g. '{{\"num_hidden_layers\": 4}}': "
                             f"{e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--model-config must be a JSON object, e.g. '{\"num_hidden_layers\": 4}'")
    return {**(TRAIN_SIZE if cfg.model in SIZED_FOR_TRAIN else {}), **extra}


def builtin_fields(cfg: TrainConfig, data_vocab: int) -> dict[str, Any]:
    """Every config field ``seqpar train`` gives a built-in model: :func:`model_overrides`, the
    vocabulary (the larger of the model's own and the ``data_vocab`` token ids the data uses, unless
    ``--model-config`` sets it) and ``max_position_embeddings`` = ``--seq-len`` (unless set)."""
    from seqpar.integrations.models import builtin_config

    own = int(builtin_config(cfg.model).vocab_size)
    return {"vocab_size": max(own, data_vocab), "max_position_embeddings": cfg.seq_len, **model_overrides(cfg)}


def memory_options(cfg: TrainConfig, device_type: str) -> dict[str, Any] | None:
    """Keywords of :func:`seqpar.reduce_memory` for the run, or None with every switch off. On the
    CPU "offload" is plain layer checkpoints (the saved inputs live in host memory already)."""
    if not (cfg.tiled_loss or cfg.tiled_mlp or cfg.checkpoint != "none"):
        return None
    checkpoint = "layers" if cfg.checkpoint == "offload" and device_type == "cpu" else cfg.checkpoint
    return dict(tiled_loss=tiles_loss(cfg),
                tiled_mlp=cfg.tiled_mlp, checkpoint=checkpoint, loss_tile=cfg.loss_tile,
                mlp_tile=cfg.mlp_tile)


def tiles_loss(cfg: TrainConfig) -> bool:
    """Whether the run's loss goes through the vocabulary in tiles: --tiled-loss, for a model with a
    vocabulary head (not a score model's [hidden, 1] head, not a DiT's flow loss)."""
    spec = OBJECTIVES[cfg.objective]
    return cfg.tiled_loss and not spec.scores and not DATA_KINDS[spec.data].model_splits


def describe_memory(cfg: TrainConfig) -> str:
    """The memory switches of a run, in words (the run header and the summary)."""
    mlp_tile = f"{cfg.mlp_tile} tokens" if cfg.mlp_tile is not None else "tiles following the shard"
    on = [f"tiled loss ({cfg.loss_tile} tokens)" if tiles_loss(cfg) else "",
          f"tiled MLP ({mlp_tile})" if cfg.tiled_mlp else "",
          f"checkpoint {cfg.checkpoint}" if cfg.checkpoint != "none" else ""]
    return ", ".join(w for w in on if w) or "none (full logits, whole MLPs, no checkpoints)"


def resolve_dtype(cfg: TrainConfig, device_type: str) -> str:
    """The --dtype name a run uses: ``auto`` is bfloat16 on CUDA (through FSDP2's mixed precision:
    float32 with ``--fsdp off`` or ``--ep``, which runs without FSDP2), float32 on the CPU."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bfloat16" if device_type == "cuda" and cfg.fsdp != "off" and cfg.ep == 1 else "float32"


def collective_timeout(cfg: TrainConfig, device_type: str) -> float:
    """Seconds for the process group's timeout: --timeout, or its default for the device."""
    if cfg.timeout is not None:
        return cfg.timeout
    return CUDA_TIMEOUT if device_type == "cuda" else CPU_TIMEOUT
