"""Everything about a ``seqpar train`` job that can be decided before any worker starts.

:func:`prepare_job` is run by the parent (or every torchrun rank) first: it checks the options,
the model (name, or a checkpoint: weights present, a config transformers builds a causal LM
from), the tokenizer, the data (read and tokenized: its token ids against the model's embedding
size), the save dir (an earlier run's checkpoints are not silently deleted) and the sequence
length against the SP split, and resolves the strategy into mesh sizes and a layout -- all
without a process group, so a bad option is one clear error instead of a traceback from every rank.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from seqpar.attention.layout import min_seq_len
from seqpar.integrations.models import BUILTIN_MODELS, build_model, builtin_config, decoder_config
from seqpar.planner import hybrid_split, plan

from .checks import check_config
from .config import FIELDS, TrainConfig, builtin_fields, model_overrides
from .data import TaskData, TextData, load_text_data
from .report import HF_DIR
from .tasks import CopyTask
from .tokenizer import load_hf_tokenizer, make_tokenizer

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

# what must match for --resume to continue the same loss curve (--steps may grow: the schedule
# then follows the new total; --sp and the strategy may change: checkpoints reshard)
RESUME_KEYS = ("model", "model_config", "data", "text_field", "seq_len", "packing", "seed", "micro_batch",
               "grad_accum", "lr", "warmup", "min_lr_ratio", "weight_decay", "dtype", "tiled_loss", "tiled_mlp",
               "loss_tile", "mlp_tile", "tokenizer", "train_on", "chat_template", "overflow", "lora_r", "lora_alpha",
               "lora_targets")


@dataclass(frozen=True)
class Job:
    cfg: TrainConfig
    world: int
    sp: int
    dp: int
    strategy: str  # "ulysses", "ring" or "hybrid" ("auto" resolved)
    mesh_kwargs: dict[str, int]  # for seqpar.init_mesh
    layout: str  # for seqpar.shard_batch
    heads: int
    kv_heads: int
    reason: str = ""  # why "auto" chose what it chose
    resume_from: str | None = None  # --resume: the checkpoint the run continues from (checked)
    resume_step: int = 0  # its step
    replaces: tuple[int, ...] = ()  # --overwrite: the steps of the earlier run's checkpoints it deletes
    data: TaskData | TextData | None = field(default=None, compare=False, repr=False)  # read by the parent


def make_data(cfg: TrainConfig, hf_tokenizer: Any | None) -> TaskData | TextData:
    """The run's data: the copy task, or ``--data`` read, tokenized and cut into rows."""
    if not cfg.data:
        return TaskData(CopyTask(cfg.seq_len, cfg.seed), cfg.eval_rows)
    return load_text_data(cfg.data, make_tokenizer(hf_tokenizer), text_field=cfg.text_field, train_on=cfg.train_on,
                          seq_len=cfg.seq_len, packing=cfg.packing, overflow=cfg.overflow, seed=cfg.seed,
                          eval_rows=cfg.eval_rows)


def _model_config(cfg: TrainConfig) -> Any:
    """The transformers config the job will build (no weights are loaded)."""
    if cfg.model in BUILTIN_MODELS:
        return builtin_config(cfg.model, **model_overrides(cfg))
    if not os.path.isdir(cfg.model):
        raise ValueError(f"--model {cfg.model!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}) nor an "
                         "existing checkpoint directory")
    if cfg.model_config:
        raise ValueError("--model-config applies to built-in models only; a checkpoint brings its own config")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model)
    except Exception as e:  # transformers raises OSError / ValueError / KeyError depending on what is wrong
        raise ValueError(f"--model {cfg.model!r} is not a loadable transformers checkpoint: "
                         f"{str(e).splitlines()[0]}") from None


def _check_checkpoint(cfg: TrainConfig, config: Any) -> Any:
    """A ``--model`` directory must hold weights and a config transformers builds a causal LM from.
    Returns that model, built on the meta device (no weights read)."""
    if not any(os.path.isfile(os.path.join(cfg.model, f)) for f in WEIGHT_FILES):
        raise ValueError(f"--model {cfg.model!r} holds no weights ({' or '.join(WEIGHT_FILES[::2])}): give a "
                         "checkpoint written by save_pretrained, or a built-in name to start from random weights")
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # transformers raises ValueError / KeyError / ImportError by what is wrong
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--model {cfg.model!r}: transformers cannot build a causal LM from its config.json "
                         f"({type(config).__name__}): {why}") from None
    return model


def _check_vocab(cfg: TrainConfig, data: TaskData | TextData, embeddings: int) -> None:
    """The token ids the data uses (padding included) must all have an embedding: compared with the
    ids used, not with the tokenizer's length (which counts added tokens the data may never use)."""
    need = data.max_token_id + 1
    if need > embeddings:
        raise ValueError(f"the data uses token ids up to {data.max_token_id} ({need} embeddings needed) but --model "
                         f"{cfg.model!r} embeds {embeddings}: give the checkpoint its own tokenizer (or --tokenizer "
                         "DIR with its vocabulary), or use a built-in model")


def _check_builtin_fields(cfg: TrainConfig, data: TaskData | TextData | None) -> None:
    """``--model-config`` may set any field of a built-in; the two the data and the length need
    must still fit them (the defaults are the data's vocabulary and ``--seq-len``)."""
    fields = model_overrides(cfg)
    need = data.max_token_id + 1 if data is not None else 0
    if "vocab_size" in fields and int(fields["vocab_size"]) < need:
        raise ValueError(f"--model-config vocab_size {fields['vocab_size']} is smaller than the {need} token ids the "
                         f"data uses: use vocab_size >= {need} or leave it out")
    pos = fields.get("max_position_embeddings")
    if pos is not None and int(pos) < cfg.seq_len:
        raise ValueError(f"--model-config max_position_embeddings {pos} is below --seq-len {cfg.seq_len}: raise it or "
                         "leave it out")


def prepare_job(cfg: TrainConfig, world: int | None = None, *, read_data: bool = True) -> Job:
    """Validate ``cfg`` for a job of ``world`` ranks (default: from --nproc / --sp / --dp) and
    resolve the strategy. Raises ValueError with the option to change."""
    world, sp, dp = check_config(cfg, world)
    config_full = _model_config(cfg)
    config = decoder_config(config_full)[0]
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    max_pos = getattr(config, "max_position_embeddings", None)
    if cfg.model not in BUILTIN_MODELS and max_pos is not None and cfg.seq_len > max_pos:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's max_position_embeddings {max_pos}: "
                         f"use --seq-len <= {max_pos}")

    strategy, reason = cfg.strategy, ""
    mesh_kwargs: dict[str, int] = {"sp": sp, "dp": dp}
    if strategy == "auto":
        hidden = int(config.hidden_size)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        p = plan(heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden, world_size=sp,
                 devices_per_node=sp, seq_len=cfg.seq_len, layers=int(config.num_hidden_layers),
                 batch=cfg.micro_batch)
        strategy, reason = p.strategy, p.reason
        if strategy == "hybrid":
            mesh_kwargs.update(ulysses=p.ulysses, ring=p.ring)
    elif strategy == "hybrid":
        try:
            u, r = hybrid_split(sp, heads)
        except ValueError:
            raise ValueError(f"--strategy hybrid cannot split --sp {sp} into ulysses x ring (each >= 2, ulysses <= "
                             f"{heads} heads): use --strategy ulysses or ring") from None
        mesh_kwargs.update(ulysses=u, ring=r)
    # ring work balanced per packed document and padding run (plain rows: the same as zigzag)
    layout = "contiguous" if strategy == "ulysses" or sp == 1 else "doc-zigzag"
    if cfg.dtype == "bfloat16" and cfg.fsdp == "off":
        raise ValueError("--dtype bfloat16 trains through FSDP2's mixed precision (bf16 compute, fp32 master "
                         "weights): use --fsdp auto or on")

    ulysses = mesh_kwargs.get("ulysses", sp if strategy == "ulysses" else 1)
    shortest = min_seq_len(sp, layout, ulysses)
    if cfg.seq_len < shortest:
        raise ValueError(f"--seq-len {cfg.seq_len} is too short for --sp {sp} with {strategy} ({layout} layout): "
                         f"use --seq-len >= {shortest} or a smaller --sp")
    if not cfg.data:
        CopyTask(cfg.seq_len, cfg.seed)  # raises for a row too short for the task
    data = None
    if read_data:  # the parent (a worker repeats none of it)
        meta = _check_checkpoint(cfg, config_full) if cfg.model not in BUILTIN_MODELS else None
        data = make_data(cfg, load_hf_tokenizer(cfg.model, cfg.tokenizer, cfg.chat_template))
        if meta is not None:
            _check_vocab(cfg, data, int(meta.get_input_embeddings().num_embeddings))
        if cfg.lora_r:  # --lora-targets must name modules of the model (peft says which it did not find)
            from .lora import add_lora

            if meta is None:
                with torch.device("meta"):
                    meta, _ = build_model(cfg.model, **builtin_fields(cfg, data.vocab_size))
            add_lora(meta, cfg)
    if cfg.model in BUILTIN_MODELS:
        _check_builtin_fields(cfg, data)
    job = Job(cfg, world, sp, dp, strategy, mesh_kwargs, layout, heads, kv_heads, reason, data=data)
    return _check_save_dir(job)


def _check_save_dir(job: Job) -> Job:
    """--resume: the checkpoint to continue from, checked; a fresh run: refused where an earlier
    run's checkpoints would be deleted, unless --overwrite (then they are listed in the job)."""
    from . import checkpoint as ckpt

    cfg = job.cfg
    found = ckpt.complete_checkpoints(cfg.save_dir)
    if cfg.resume:
        if not found:
            raise ValueError(f"--resume: no complete checkpoint in {ckpt.checkpoint_root(cfg.save_dir)!r}; "
                             "run without --resume to start fresh")
        step, path = found[-1]
        check_resumable(job, ckpt.read_trainer_state(path), path)
        return dataclasses.replace(job, resume_from=path, resume_step=step)
    if found and not cfg.overwrite:
        n, them = (f"{len(found)} checkpoints", "them") if len(found) > 1 else ("1 checkpoint", "it")
        raise ValueError(f"--save-dir {cfg.save_dir!r} holds {n} of an earlier run (the latest at step "
                         f"{found[-1][0]}): --resume continues it, --overwrite deletes {them} and starts afresh, or "
                         "choose another --save-dir")
    export = os.path.join(cfg.save_dir, HF_DIR)
    if os.path.isdir(export) and os.listdir(export) and not cfg.overwrite:
        raise ValueError(f"--save-dir {cfg.save_dir!r} holds an earlier run's export ({export}): move it, or "
                         "--overwrite deletes it and starts afresh, or choose another --save-dir")
    return dataclasses.replace(job, replaces=tuple(step for step, _ in found))


def check_resumable(job: Job, state: dict[str, Any], path: str) -> None:
    """Raise ValueError unless the checkpoint at ``path`` was written by the same run's options."""
    # an option the checkpoint's seqpar did not have yet ran at its default
    old = {k: FIELDS[k].default for k in RESUME_KEYS} | state.get("config", {})
    diff = [k for k in RESUME_KEYS if old.get(k) != getattr(job.cfg, k)]
    if diff:
        what = ", ".join(f"--{k.replace('_', '-')} {old.get(k)!r} -> {getattr(job.cfg, k)!r}" for k in diff)
        raise ValueError(f"--resume: {path} was written with other options ({what}); use the same ones to "
                         "continue the same run")
    if state.get("dp") != job.dp:
        raise ValueError(f"--resume: {path} was written with dp={state.get('dp')} and this run has dp={job.dp}, "
                         f"so the data order would differ: use --dp {state.get('dp')}")
    if int(state["step"]) > job.cfg.steps:
        raise ValueError(f"--resume: {path} is at step {state['step']}, past --steps {job.cfg.steps}")
