"""``seqpar train --objective kto`` against TRL 1.16's ``KTOTrainer`` on the same file, model and optimizer:
the weights after two steps are TRL's (float32). The first step runs at the reference (KL 0, every
ratio 0); the second exercises the KL term, estimated from each row's KL row (TRL's rotated
completions) by the policy and the reference. AdamW with a huge epsilon (and a learning rate to
match) makes an update its first moment: the two runs' updates agree whatever their second-moment
betas (seqpar's 0.95, TRL's 0.999)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from trl_fixtures import chat_tokenizer, tiny_lm

ROWS = [
    {"prompt": "what is two plus two", "completion": " four", "label": True},
    {"prompt": "which color is the sky", "completion": " the quick brown fox", "label": False},
    {"prompt": "tell me a story", "completion": " once upon a time there was a cat", "label": True},
    {"prompt": "name three fruits", "completion": " blue", "label": False},
    {"prompt": "hello how are you", "completion": " fine thanks", "label": True},
    {"prompt": "what is two plus two", "completion": " a lazy dog", "label": False},
]
EPS = LR = 1e4  # the update: lr * m / (sqrt(v) + eps) ~= m, the first moment alone
STEPS, WEIGHT_TOL = 2, 1e-6


def _trl_weights(ckpt: str, data: str, out: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """TRL's weights after the steps, and the KL term it logged at each step."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    args = KTOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=len(ROWS),
                     max_steps=STEPS, learning_rate=LR, adam_epsilon=EPS, max_grad_norm=0.0,
                     lr_scheduler_type="constant", weight_decay=0.0, beta=0.1, logging_steps=1, save_strategy="no",
                     seed=0)
    trainer = KTOTrainer(model=model, ref_model=ref, args=args, processing_class=AutoTokenizer.from_pretrained(ckpt),
                         train_dataset=load_dataset("json", data_files=data, split="train"))
    trainer.train()
    kl = [log["kl"] for log in trainer.state.log_history if "kl" in log]
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, kl


@pytest.mark.distributed
@pytest.mark.heavy
def test_two_kto_steps_give_trls_weights(tmp_path):
    from seqpar.train import TrainConfig, train
    from seqpar.train.checkpoint import load_model_weights

    ckpt = str(tmp_path / "ckpt")
    tiny_lm(vocab=256).save_pretrained(ckpt)
    chat_tokenizer().save_pretrained(ckpt)
    data = tmp_path / "unpaired.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    want, kl = _trl_weights(ckpt, str(data), str(tmp_path / "trl"))
    assert len(kl) == STEPS and kl[0] == 0 and (STEPS < 2 or kl[1] > 0), kl  # the KL term counts at step 2

    summary = train(TrainConfig(model=ckpt, objective="kto", data=[str(data)], seq_len=64, sp=2, micro_batch=len(ROWS),
                                steps=STEPS, lr=LR, adam_eps=EPS, warmup=0, min_lr_ratio=1.0, grad_clip=0.0,
                                eval_rows=0, dtype="float32", tiled_mlp=False, checkpoint="none", progress=False,
                                plot=False, save_dir=str(tmp_path / "run")))
    from transformers import AutoModelForCausalLM

    model = load_model_weights(summary.checkpoint, AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32))
    got = model.state_dict()
    moved = max(float((want[k] - tiny_lm(vocab=256).state_dict()[k]).abs().max()) for k in want)
    assert moved > 1e-3  # the steps changed the weights
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= WEIGHT_TOL, worst
