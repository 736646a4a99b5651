"""``seqpar export CHECKPOINT --out DIR``: a ``seqpar train`` checkpoint as a transformers checkpoint.

CHECKPOINT is a ``step_*`` directory under ``<save-dir>/checkpoints``, or the save dir itself (its
latest complete checkpoint). DIR gets ``save_pretrained`` output -- model.safetensors, config.json,
generation_config.json and the run's tokenizer -- that ``AutoModelForCausalLM.from_pretrained(DIR)``
loads (a flow-matching run's DiT: diffusers' files, that its class's ``from_pretrained`` loads).
A LoRA run exports its adapters merged into the weights, or peft's adapter files
(``--lora-export adapter``: load with ``peft.AutoPeftModelForCausalLM.from_pretrained(DIR)``; a
built-in base model is written beside them, in DIR/base). One process, no GPU needed.
"""

from __future__ import annotations

import argparse
import os

import torch

NO_TOKENIZER = " (no tokenizer: the run read bytes or the copy task)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a seqpar train checkpoint as a transformers checkpoint (save_pretrained)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a step_* checkpoint directory, or a --save-dir (its "
                   "latest checkpoint)")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write (a new or empty directory)")
    p.add_argument("--lora-export", choices=("merged", "adapter"), default="",
                   help="for a LoRA run: merged (adapters folded into the weights) or adapter (peft's files) "
                   "(default: the run's --lora-export)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="cast the weights (default: as trained, float32)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from seqpar.train.export import export_checkpoint

    hf_logging.disable_progress_bar()
    e = export_checkpoint(args.checkpoint, args.out, lora=args.lora_export,
                          dtype=DTYPES[args.dtype] if args.dtype else None)
    size = sum(os.path.getsize(os.path.join(e.out, f)) for f in e.files)
    what = {"": "the model", "merged": "the model, LoRA adapters merged", "adapter": "the LoRA adapter"}[e.lora]
    print(f"seqpar export: {what} of step {e.step} ({e.checkpoint}) -> {e.out}: {len(e.files)} files, "
          f"{size / 2**20:,.1f} MiB{'' if e.tokenizer or e.loader else NO_TOKENIZER}")
    load = e.loader or ("peft.AutoPeftModelForCausalLM.from_pretrained" if e.lora == "adapter"
                        else "transformers.AutoModelForCausalLM.from_pretrained")
    print(f"  load with {load}({e.out!r})")
    return 0
