"""Sequence parallelism in a TRL ``SFTTrainer`` script, packed (padding-free) by default: one added line.

    torchrun --nproc-per-node 2 examples/sft_sp.py                # CPU: 2 processes (gloo), sp=2
    torchrun --nproc-per-node 8 examples/sft_sp.py --sp 8         # 8 GPUs, unchanged
    python examples/sft_sp.py --no-packing                        # one process, padded rows, no SP

Packed rows restart their position ids at every document; seqpar keeps the documents apart
exactly under every strategy (TRL refuses packing with accelerate's context parallelism).
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import Dataset
from tiny_data import byte_tokenizer, load_rows
from trl import SFTConfig, SFTTrainer

from seqpar.integrations.models import build_model
from seqpar.integrations.trainer.mixin import parallelize_trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, default=2, help="ranks per sequence (dp = processes / sp)")
    parser.add_argument("--strategy", default="ulysses", help="ulysses, ring or hybrid")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-packing", dest="packing", action="store_false", help="padded rows instead")
    parser.add_argument("--output-dir", default="runs/example-sft")
    opts = parser.parse_args()

    torch.manual_seed(0)
    model, _ = build_model("tiny-llama")
    train = Dataset.from_list(load_rows())  # already tokenized: TRL skips its own tokenization
    args = SFTConfig(output_dir=opts.output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     max_steps=opts.steps, learning_rate=3e-3, warmup_steps=2, logging_steps=5, save_steps=10,
                     packing=opts.packing, padding_free=opts.packing, max_length=512 if opts.packing else None,
                     bf16=False, report_to=[], seed=0, use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=byte_tokenizer())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parallelize_trainer(trainer, sp=opts.sp, strategy=opts.strategy)  # <- the seqpar line
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {trainer.state.global_step} steps")


if __name__ == "__main__":
    main()
