"""Sequence parallelism in a plain transformers ``Trainer`` script: one added line.

    torchrun --nproc-per-node 2 examples/trainer_sp.py            # CPU: 2 processes (gloo), sp=2
    torchrun --nproc-per-node 8 examples/trainer_sp.py --sp 4     # 8 GPUs: dp=2 x sp=4, unchanged
    python examples/trainer_sp.py                                 # one process: the same run without SP

Every rank of an SP group reads the same batches (the data is split over dp only) and keeps its
slice of each sequence; the logged losses are those of the run without SP (up to float rounding).
"""

from __future__ import annotations

import argparse
import os

import torch
from tiny_data import PadCollator, load_rows
from transformers import Trainer, TrainingArguments

from seqpar.integrations.models import build_model
from seqpar.integrations.trainer.mixin import parallelize_trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, default=2, help="ranks per sequence (dp = processes / sp)")
    parser.add_argument("--strategy", default="ulysses", help="ulysses, ring or hybrid")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", default="runs/example-trainer")
    opts = parser.parse_args()

    torch.manual_seed(0)
    model, _ = build_model("tiny-llama")  # built-in: Llama-style, 2 layers, 128 byte ids
    rows = load_rows()
    args = TrainingArguments(output_dir=opts.output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=opts.steps, learning_rate=3e-3, warmup_steps=2, logging_steps=5,
                             save_steps=10, eval_strategy="steps", eval_steps=10, report_to=[], seed=0,
                             use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows[:-8], eval_dataset=rows[-8:],
                      data_collator=PadCollator())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parallelize_trainer(trainer, sp=opts.sp, strategy=opts.strategy)  # <- the seqpar line
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"eval loss {metrics['eval_loss']:.4f} after {trainer.state.global_step} steps")


if __name__ == "__main__":
    main()
