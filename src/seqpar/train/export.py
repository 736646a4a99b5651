"""``seqpar export``: a ``seqpar train`` checkpoint as a transformers checkpoint, in one process.

A checkpoint (``<save-dir>/checkpoints/step_N``) holds the weights (torch.distributed.checkpoint,
sharded or not), the model's ``config.json``, the run's tokenizer and options. Export rebuilds the
model from that config on the meta device (LoRA: with the run's adapters), reads the weights into
it without a process group, and writes ``save_pretrained`` output through
:func:`seqpar.integrations.hf.export.write_pretrained` -- the same writer as ``seqpar train
--export-hf`` and ``seqpar.save_pretrained``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from seqpar.integrations.hf.export import LORA_EXPORTS, write_pretrained

from . import checkpoint as ckpt
from .config import FIELDS, TrainConfig
from .safe_load import check_plain


@dataclass(frozen=True)
class Exported:
    """What :func:`export_checkpoint` wrote."""

    out: str
    checkpoint: str
    step: int
    files: list[str]
    lora: str  # "" (no LoRA), "merged" or "adapter"
    tokenizer: bool
    loader: str = ""  # what loads it, when not transformers' AutoModelForCausalLM / peft's AutoPeftModel


def resolve_checkpoint(path: str) -> str:
    """A ``step_*`` checkpoint directory, or a --save-dir (its latest complete checkpoint). ValueError
    when ``path`` is neither."""
    if os.path.isfile(os.path.join(path, ckpt.TRAINER_FILE)):
        return path
    latest = ckpt.latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"{path!r} is neither a seqpar train checkpoint (a step_* directory with "
                         f"{ckpt.TRAINER_FILE}) nor a --save-dir holding one")
    return latest


def export_checkpoint(path: str, out: str, *, lora: str = "", dtype: torch.dtype | None = None) -> Exported:
    """Write the checkpoint at ``path`` (see :func:`resolve_checkpoint`) as ``save_pretrained``
    output in ``out``. ``lora``: merged or adapter (default: the run's --lora-export); ``dtype``:
    cast the weights (default: as trained). ValueError for a checkpoint it cannot export, or one
    that holds a pickled object (naming the file; nothing of it is unpickled)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .lora import add_lora

    path = resolve_checkpoint(path)
    check_plain(path)  # tensors and plain data only: a pickled object is a ValueError naming its file
    state = ckpt.read_trainer_state(path)
    cfg = TrainConfig(**{k: v for k, v in state["config"].items() if k in FIELDS})
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path} holds no config.json (written by an older seqpar train): load its weights with "
                         "seqpar.train.checkpoint.load_model_weights into the model, then save_pretrained")
    if lora and lora not in LORA_EXPORTS:
        raise ValueError(f"--lora-export {lora!r}: choose one of {list(LORA_EXPORTS)}")
    lora = (lora or cfg.lora_export) if cfg.lora_r else ""
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"--out {out!r} is not empty: choose a new directory")
    if _is_dit(path):
        return _export_dit(path, out, cfg, int(state["step"]), lora, dtype)
    config = AutoConfig.from_pretrained(path)
    param_dtype = torch.float64 if cfg.dtype == "float64" else torch.float32  # the dtype it was trained in
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype)
    model.to_empty(device="cpu")  # storage only: every weight is read from the checkpoint next
    peft = add_lora(model, cfg) if cfg.lora_r else None
    ckpt.load_model_weights(path, model)
    tok_dir = os.path.join(path, ckpt.TOKENIZER_DIR)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir) if os.path.isdir(tok_dir) else None
    root = peft if peft is not None else model
    write_pretrained(root, root.state_dict(), out, tokenizer=tokenizer, lora=lora or "merged", dtype=dtype)
    files = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    return Exported(out=os.path.abspath(out), checkpoint=os.path.abspath(path), step=int(state["step"]), files=files,
                    lora=lora, tokenizer=tokenizer is not None)


def _is_dit(path: str) -> bool:
    """Whether the checkpoint's config.json is a diffusers model's (it names its ``_class_name``)."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        return "_class_name" in json.load(f)


def _export_dit(path: str, out: str, cfg: TrainConfig, step: int, lora: str, dtype: torch.dtype | None) -> Exported:
    """A flow-matching checkpoint as a diffusers ``save_pretrained`` directory, LoRA merged
    (:func:`seqpar.integrations.diffusers.export.write_dit_pretrained`)."""
    from seqpar.integrations.diffusers.catalog import build_dit
    from seqpar.integrations.diffusers.export import lora_config_of, write_dit_pretrained

    from .lora import add_dit_lora

    if lora == "adapter":
        raise ValueError("--lora-export adapter: a diffusers DiT is exported with its LoRA adapters merged into the "
                         "weights (from_pretrained loads it): use --lora-export merged")
    param_dtype = torch.float64 if cfg.dtype == "float64" else torch.float32  # the dtype it was trained in
    model = build_dit(path, dtype=param_dtype, weights=False)
    if cfg.lora_r:
        add_dit_lora(model, cfg)
    ckpt.load_model_weights(path, model)
    write_dit_pretrained(model, model.state_dict(), out, lora=lora_config_of(model), dtype=dtype)
    files = sorted(os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs)
    return Exported(out=os.path.abspath(out), checkpoint=os.path.abspath(path), step=step, files=files, lora=lora,
                    tokenizer=False, loader=f"diffusers.{type(model).__name__}.from_pretrained")


def export_run(ctx: Any, export: str) -> None:
    """``--export-hf`` at the end of a run (every rank): a transformers model through
    :func:`seqpar.integrations.hf.export.save_pretrained` (a collective), a diffusers DiT through
    :func:`seqpar.integrations.diffusers.export.save_dit_pretrained` (rank 0 writes; LoRA merged)."""
    import torch.distributed as dist

    from seqpar.integrations.models import is_diffusers_model

    cfg = ctx.job.cfg
    if is_diffusers_model(ctx.model):
        from seqpar.integrations.diffusers.export import save_dit_pretrained

        save_dit_pretrained(ctx.model, export, rank=ctx.rank)
        dist.barrier()
        return
    from seqpar.integrations.hf.export import save_pretrained

    save_pretrained(ctx.policy, export, ctx.mesh, tokenizer=ctx.job.tokenizer, lora=cfg.lora_export)
