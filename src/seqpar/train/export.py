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
