"""The peer seqpar's longest sequence is measured against: DeepSpeed's ALST (Arctic Long Sequence
Training, deepspeed 0.19.8, ``deepspeed.runtime.sequence_parallel.ulysses_sp``), set up on a bench
case's model as DeepSpeed's tutorial ("Arctic Long Sequence Training (ALST) for HF Transformers
integration") and its reference trainer (ArcticTraining's ``SFTTrainer.loss``) do::

    deepspeed.init_distributed("gloo")             adopts the running process group
    UlyssesSPAttentionHF.register_with_transformers  Ulysses over the model's "sdpa" attention (returns the mpu)
    LlamaMLP.forward = tiled_mlp_forward           TiledMLP, ceil(seqlen / hidden) shards, agreed by a MAX
    model.gradient_checkpointing_enable(...)       non-reentrant activation checkpoints, one per decoder layer,
      with get_checkpoint_hidden_states_offloading_ctx_manager()   their inputs offloaded to CPU (on a CPU
                                                   rank: a no-op, the inputs already live in host memory)
    UlyssesSPDataLoaderAdapter                     shards the batch, pre-shifts labels into shift_labels
    TiledFusedLogitsLoss                           head + loss in shards of ~1 GiB of fp32 logits, backward
                                                   inside forward; the loss averaged over SP ranks through a
                                                   differentiable all_gather weighted by each rank's tokens

The optimizer side is the bench's, the same for both systems: fused AdamW on every parameter, gradients
averaged over the ranks (one in-place all-reduce per parameter: what DDP or ZeRO stage 0 leave
behind, without their buckets). Not run here: ZeRO-3 and its CPU optimizer offload (they shard or
move the optimizer side, not the sequence; seqpar's counterpart is FSDP2), Liger-kernel (Triton, GPU
only: ALST's own fallback without it is the tiled loss above), ``PYTORCH_CUDA_ALLOC_CONF`` (CUDA).

Every step runs in a fresh process (the registration replaces transformers' "sdpa" attention and
the MLP class's forward for the whole process), through :func:`seqpar.bench.peak.measured_step`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .build import adamw
from .case import BenchCase, model_fields

INSTALL = "DS_BUILD_OPS=0 pip install deepspeed==0.19.8"
LOGIT_SHARD_BYTES = 2**30  # ArcticTraining's SFTTrainer.loss: "parameterize to about 1GB fp32 logits shards"


def deepspeed_version() -> str | None:
    """The installed deepspeed's version, None when it is not installed (nothing is imported)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None


def logit_shards(tokens: int, vocab: int) -> int:
    """ArcticTraining's number of loss shards for ``tokens`` local tokens: about 1 GiB of fp32 logits each."""
    return max(1, math.ceil(tokens * vocab * 4 / LOGIT_SHARD_BYTES))


def mlp_shards(tokens: int, hidden: int) -> int:
    """The tutorial's TiledMLP shards: ``ceil(seqlen / hidden)`` (at least 1)."""
    return max(1, math.ceil(tokens / hidden))


def _tiled_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The tutorial's ``tiled_mlp_forward_common``, as written there (LlamaMLP.forward replaced)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    num_shards = mlp_shards(x.shape[1], x.shape[2])
    if dist.get_world_size() > 1:  # every rank runs the same number of shards
        t = torch.tensor(num_shards, device=x.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        num_shards = int(t.item())
    compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]

    def mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    return TiledMLP.apply(mlp_forward, self, x, num_shards, compute_params)


def register(model: Any, world: int) -> Any:
    """Once per process, with an instantiated model of the measured attention shape: DeepSpeed's comm
    over the running process group, Ulysses registered over "sdpa", TiledMLP patched into LlamaMLP.
    Returns the SP group (None at P = 1)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.models.llama import modeling_llama

    from seqpar import compat

    if model.config.model_type != "llama":
        raise ValueError(f"the ALST harness patches LlamaMLP (the tutorial's TiledMLP example); got a "
                         f"{model.config.model_type!r} model: use a Llama-shaped model")
    compat.deepspeed_skip_cpu_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world, micro_batch_size=1,
        seq_length_is_variable=True)
    modeling_llama.LlamaMLP.forward = _tiled_mlp_forward
    return None if mpu is None else mpu.get_sequence_parallel_group()


def warm_config(case: BenchCase) -> str:
    """A tiny model of the case's attention shape (heads, KV heads, head size: what the registration
    reads), one layer, hidden 32: it loads every code path before the baseline is taken."""
    import json

    fields = json.loads(case.model_config) if case.model_config else {}
    return json.dumps({**fields, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "vocab_size": 128})


def case_model(case: BenchCase, device: torch.device) -> Any:
    """The case's model, seeded as seqpar's bench seeds it (the same weights), on "sdpa"."""
    from seqpar.integrations.models import build_model
    from seqpar.train.config import DTYPES

    torch.manual_seed(case.seed)
    model, _ = build_model(case.model, dtype=DTYPES[case.dtype], attn_implementation="sdpa", **model_fields(case))
    return model.to(device)


def assemble(model: Any, sp_group: Any, device: torch.device) -> dict[str, Any]:
    """``model`` (registered: :func:`register`) with activation checkpoints on (transformers'
    non-reentrant checkpointing), its AdamW and the checkpoint-offload context manager."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return {"model": model, "opt": adamw(model), "sp_group": sp_group,
            "offload": get_checkpoint_hidden_states_offloading_ctx_manager(), "device": device}


def build(model: Any, sp_group: Any, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """:func:`assemble`, then one warm-up step on a short row: gradients and AdamW states exist."""
    built = assemble(model, sp_group, device)
    warm = max(16, 4 * dist.get_world_size())
    step(built, loader_batch(built, lm_row(warm, model.config.vocab_size, seed + 1)))
    return built


def lm_row(seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The row both systems train on: ``seq_len`` random tokens, every one a target (``labels`` =
    ``input_ids``), ``position_ids`` 0..S-1 (ALST's data loader needs them). ``[1, S]`` tensors."""
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq_len)[None]}


def loader_batch(built: dict[str, Any], row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's shard of ``row`` through ``UlyssesSPDataLoaderAdapter`` (every rank's loader yields
    the same row; the adapter gathers them and hands out the first one's shards), or the row with
    ``shift_labels`` at P = 1."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from torch.utils.data import DataLoader

    group = built["sp_group"]
    if group is None:
        labels = torch.nn.functional.pad(row["labels"], (0, 1), value=-100)[:, 1:]
        return {"input_ids": row["input_ids"], "position_ids": row["position_ids"], "shift_labels": labels}
    loader = DataLoader([row], batch_size=None)
    adapted = UlyssesSPDataLoaderAdapter(loader, sp_rank=dist.get_rank(group), sp_group=group,
                                         sp_world_size=dist.get_world_size(group), device=torch.device("cpu"))
    return next(iter(adapted))


def forward_backward(built: dict[str, Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward and backward inside the offload context with the loss of ArcticTraining's
    ``SFTTrainer.loss`` (:func:`alst_loss`), then the gradients averaged over the ranks (what the
    DeepSpeed engine's data-parallel averaging does, one in-place all-reduce per parameter). Returns
    the loss."""
    model = built["model"]
    batch = {k: v.to(built["device"]) for k, v in batch.items()}
    with built["offload"]:
        loss = alst_loss(model, batch, built["sp_group"])
        loss.backward()
    world = dist.get_world_size()
    if world > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
    return loss.detach()


def step(built: dict[str, Any], batch: dict[str, torch.Tensor]) -> None:
    """One ALST training step: :func:`forward_backward`, then AdamW."""
    forward_backward(built, batch)
    built["opt"].step()
    built["opt"].zero_grad(set_to_none=True)


def alst_loss(model: Any, batch: dict[str, torch.Tensor], group: Any) -> torch.Tensor:
    """ArcticTraining's ``SFTTrainer.loss`` for ``sequence_parallel_size > 1`` without Liger: the decoder's
    hidden states, TiledFusedLogitsLoss over ~1 GiB logit shards (a sum of per-shard token means
    times their tokens), divided by this rank's tokens, then the token-weighted mean over the SP
    ranks through a differentiable all_gather. At P = 1 the same tiled loss, not gathered."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    shift_labels = batch["shift_labels"]
    hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         use_cache=False).last_hidden_state  # [1, S/P, H]
    vocab = model.config.vocab_size

    def fused_logits_loss_fn(model_with_head: Any, hidden_states: torch.Tensor, shift_labels: torch.Tensor
                             ) -> torch.Tensor:
        logits = model_with_head.lm_head(hidden_states)
        if all((shift_labels == -100).squeeze()):
            return (logits.sum() * 0.0).float()  # a shard without targets: grads set, nothing added
        good_items = (shift_labels != -100).squeeze().sum()
        loss = model_with_head.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=shift_labels)
        return loss * good_items

    shards = logit_shards(shift_labels.numel(), vocab)
    total = TiledFusedLogitsLoss.apply(fused_logits_loss_fn, model, hidden, shift_labels, None, shards,
                                       [model.lm_head.weight], "sum")
    good = (shift_labels != -100).squeeze().sum()
    loss = total / max(good, 1)
    if group is None:
        return loss
    import torch.distributed.nn.functional as dnn

    losses = dnn.all_gather(loss, group=group)
    goods = dnn.all_gather((shift_labels != -100).view(-1).sum(), group=group)
    return sum(lo * n for lo, n in zip(losses, goods, strict=True)) / sum(goods)


def warm(case: BenchCase, device: torch.device) -> Any:
    """Register ALST (:func:`register`) with a tiny model of the case's attention shape and run one
    step of it: every code path is loaded before the baseline is taken. Returns the SP group."""
    import gc
    from dataclasses import replace

    tiny = case_model(replace(case, model_config=warm_config(case), sizing="builtin"), device)
    group = register(tiny, dist.get_world_size())
    built = build(tiny, group, device)
    del built, tiny
    gc.collect()
    return group


def alst_peak(case: BenchCase, cap_bytes: int | None, live: bool | str, device: torch.device) -> dict[str, Any]:
    """One ALST step's peak on this process (:func:`seqpar.bench.peak.measured_step`, or on a GPU
    :func:`~seqpar.bench.peak.measured_cuda_step`): registered and warmed on a tiny model first."""
    import os

    from .peak import measured_cuda_step, measured_step

    os.environ.setdefault("DS_ACCELERATOR", device.type)  # DeepSpeed's own setting: no detection, no warning
    row = lm_row(case.seq_len, model_vocab(case), case.seed)
    held: dict[str, Any] = {}

    def prepare() -> dict[str, Any]:
        built = build(case_model(case, device), held["group"], device, case.seed)
        held["batch"] = loader_batch(built, row)
        return built

    def warmed() -> None:
        held["group"] = warm(case, device)

    if device.type == "cuda":
        return measured_cuda_step(warmed, prepare, lambda built: step(built, held["batch"]), device)
    return measured_step(warmed, prepare, lambda built: step(built, held["batch"]), cap_bytes, live)


def alst_peak_worker(rank: int, world: int, case: BenchCase, cap_bytes: int | None, live: bool | str = False
                     ) -> dict[str, Any]:
    """:func:`alst_peak` on one of ``world`` fresh local CPU processes (the counterpart of
    :func:`seqpar.bench.peak.peak_worker`, for :func:`seqpar.bench.peak.try_step`)."""
    return alst_peak(case, cap_bytes, live, torch.device("cpu"))


def alst_cuda_worker(rank: int, world: int, case: BenchCase, cap_bytes: int | None, live: bool | str = False
                     ) -> dict[str, Any]:
    """:func:`alst_peak` on this process's GPU (one process: P = 1, ALST without sequence parallelism)."""
    torch.cuda.set_device(rank)
    return alst_peak(case, cap_bytes, live, torch.device("cuda", rank))


def model_vocab(case: BenchCase) -> int:
    """The vocabulary of the case's model."""
    from seqpar.integrations.models import builtin_config

    return int(builtin_config(case.model, **model_fields(case)).vocab_size)

