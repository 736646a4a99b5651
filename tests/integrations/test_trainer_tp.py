"""accelerate's ``ParallelismConfig(dp_shard_size=2, tp_size=2)`` with ``parallelize_trainer(sp=2)``.

seqpar's sp borrows its ranks from accelerate's dp_shard (:mod:`seqpar.integrations.trainer.parallelism`),
so the smallest world where that accelerate config is legal is 4 processes: seqpar's mesh is
``dp_shard=1 x sp=2 x tp=2``. The same script with ``ParallelismConfig(dp_shard_size=2)`` alone and
no seqpar (2 processes, the Trainer's DDP, 2 rows each; transformers' causal-LM loss without its
float32 cast, :func:`_causal_lm_loss64`) is the reference; the seqpar run reads the
same 4 rows per step as one batch (its dp is 1). Float64, two optimizer steps of SGD at learning
rate 1 (a weight's change is its gradient) with gradient accumulation 2 and clipping at norm 0.5
(transformers' mixed-mesh norm over the TP DTensors and the replicated weights): every logged loss
within 1e-9, every weight within 1e-8.

accelerate 1.16 refuses any ``ParallelismConfig`` of more than one process on a CPU ("only compatible
with FSDP2 / Multi{Device} / DeepSpeed", DistributedType.MULTI_CPU here), so both runs build the
Trainer plainly and then give accelerate the state it builds on GPUs (:func:`_parallelism_as_on_gpus`:
the config and its device mesh); everything after -- parallelize_trainer, accelerate's TP preparation
of the model (no DDP), the Trainer's loop -- runs as it does there.
"""

from __future__ import annotations

import os

import pytest
import torch
from trainer_rows import VOCAB, collate, rows

from seqpar.comm.launch import run_distributed

MICRO = 2
LOSS_TOL, WEIGHT_TOL = 1e-9, 1e-8


def _parallelism_as_on_gpus(trainer, pc) -> None:
    """What ``Accelerator(parallelism_config=pc)`` sets up on GPUs (module doc): the config on its
    state and the device mesh the config builds."""
    trainer.args.parallelism_config = pc
    state = trainer.accelerator.state
    state.parallelism_config = pc
    state.device_mesh = pc.get_device_mesh("cpu")


class Float64Log:
    """A callback (in both runs) that keeps the Trainer's running loss sum in float64, so that the
    logged losses compare at 1e-9 rather than at float32's ulp. Built lazily: TrainerCallback is
    imported with transformers."""

    def __new__(cls, trainer):
        from transformers import TrainerCallback

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                trainer._tr_loss = trainer._tr_loss.to(torch.float64)  # set by train() just before

        return _Callback()


def _causal_lm_loss64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                      **kwargs):
    """transformers' ``ForCausalLMLoss`` without its cast of the logits to float32 (which would round
    a float64 model's loss and gradients to float32): the reference's loss, the float64 oracle."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat = logits.reshape(-1, vocab_size)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(flat, shift_labels.reshape(-1).to(flat.device), ignore_index=ignore_index,
                                             reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def train(out: str, *, tp: int) -> dict:
    """The user's script: ``tp=2`` is ParallelismConfig(dp_shard_size=2, tp_size=2) plus the seqpar
    line; ``tp=1`` is ParallelismConfig(dp_shard_size=2) alone."""
    from accelerate import ParallelismConfig
    from transformers import Trainer, TrainingArguments

    from seqpar.integrations.models import build_model
    from seqpar.integrations.trainer.mixin import parallelize_trainer

    torch.manual_seed(0)
    net, _ = build_model("tiny-llama", dtype=torch.float64, vocab_size=VOCAB)
    batch = MICRO * 2 if tp > 1 else MICRO  # seqpar's dp is 1: one batch of both dp_shard ranks' rows
    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], per_device_train_batch_size=batch,
                             gradient_accumulation_steps=2, max_steps=2, learning_rate=1.0, optim="sgd",
                             lr_scheduler_type="constant", max_grad_norm=0.5, weight_decay=0.0, logging_steps=1,
                             save_strategy="no", seed=0, disable_tqdm=True)
    trainer = Trainer(model=net, args=args, train_dataset=rows(32, 1), data_collator=collate)
    trainer.add_callback(Float64Log(trainer))
    _parallelism_as_on_gpus(trainer, ParallelismConfig(dp_shard_size=2, tp_size=tp))
    if tp > 1:
        parallelize_trainer(trainer, sp=2)  # the seqpar line (its loss is float64 already)
    else:
        net.loss_function = _causal_lm_loss64
    trainer.train()
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in net.named_parameters()}
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
            "weights": {n: p.detach().clone() for n, p in full.items()},
            "sharded": sum(type(p).__name__ == "DTensor" for p in net.parameters())}


def _worker(rank: int, world: int, out: str, tp: int) -> dict:
    torch.set_num_threads(1)
    return train(os.path.join(out, f"tp{tp}"), tp=tp)


@pytest.mark.distributed
@pytest.mark.heavy  # two Trainer launches (6 processes importing the Trainer): over make test's budget here
def test_accelerate_tp_with_seqpar_sp_equals_dp_shard_alone(tmp_path):
    ref = run_distributed(_worker, 2, str(tmp_path), 1, timeout=600.0)
    runs = run_distributed(_worker, 4, str(tmp_path), 2, timeout=600.0)
    want = ref[0]
    assert len(want["losses"]) == 2 and want["sharded"] == 0
    assert all(n > 0.5 for n in want["norms"])  # clipping was active
    for rank, res in enumerate(runs):
        assert res["sharded"] > 0, "the model was not split over tp"
        for a, b in zip(res["losses"], want["losses"], strict=True):
            assert abs(a - b) <= LOSS_TOL, (rank, res["losses"], want["losses"])
        for a, b in zip(res["norms"], want["norms"], strict=True):
            assert abs(a - b) <= LOSS_TOL * max(1.0, abs(b)), (rank, res["norms"], want["norms"])
        for name, w in want["weights"].items():
            d = float((res["weights"][name] - w).abs().max())
            assert d <= WEIGHT_TOL, (rank, name, d)
    start = _start_weights()
    assert any(float((w - start[n]).abs().max()) > 1e-3 for n, w in want["weights"].items())


def _start_weights() -> dict:
    from seqpar.integrations.models import build_model

    torch.manual_seed(0)
    net, _ = build_model("tiny-llama", dtype=torch.float64, vocab_size=VOCAB)
    return dict(net.state_dict())


def test_trainer_mesh_from_parallelism_config():
    from accelerate import ParallelismConfig

    from seqpar.integrations.trainer.parallelism import trainer_mesh_kwargs

    assert trainer_mesh_kwargs(None, 2) == {"sp": 2}
    assert trainer_mesh_kwargs(ParallelismConfig(dp_shard_size=4), 2) == {"sp": 2}  # no tp: seqpar's 2-D mesh
    assert trainer_mesh_kwargs(ParallelismConfig(dp_shard_size=2, tp_size=2), 2) == \
        {"dp_replicate": 1, "dp_shard": 1, "sp": 2, "tp": 2}
    assert trainer_mesh_kwargs(ParallelismConfig(dp_replicate_size=2, dp_shard_size=4, tp_size=2), 2) == \
        {"dp_replicate": 2, "dp_shard": 2, "sp": 2, "tp": 2}
    with pytest.raises(ValueError, match="sp=4 must divide accelerate's dp_shard_size=2"):
        trainer_mesh_kwargs(ParallelismConfig(dp_shard_size=2, tp_size=2), 4)
