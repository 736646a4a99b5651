"""TRL's preference, reward and RL trainers under ``seqpar.parallelize_trainer``: ``DPOTrainer``,
``RewardTrainer`` and ``GRPOTrainer``, exact.

TRL's own ``compute_loss`` runs unchanged; only the model it calls is a stand-in
(:class:`ShardedModel`) that takes TRL's whole-batch call, runs the model on this rank's shard and
hands back whole-batch per-token (or per-row) outputs, the same on every SP rank::

    TRL compute_loss                      model(input_ids [B, S], attention_mask, labels, fused_lm_head=True)
      ShardedModel                          shard_batch -> [B, S/P] with the targets shifted before sharding
        the model (parallelized)            TRL's fused LM head on the shard (shift_labels: no second shift)
        log_probs, entropy, ...   # [B, S/P]  -> all-gather over sp -> [B, S] original order -> [:, :-1]
      TRL's loss and metrics                on [B, S-1] tensors equal to the unsharded run's

Why TRL's head and formulas, not seqpar's objectives (:mod:`seqpar.objectives`, the same formulas): TRL's
fused LM head keeps its log-sum-exp statistics in float32 whatever the model's dtype, and sums the
per-token log-probs in that precision. The unsharded script's loss is therefore float32-rounded; running
the very same kernel on each shard and TRL's own reductions on the gathered ``[B, S-1]`` tensors is what
makes the sharded step equal to it, metrics included.

Gradients: every SP rank computes the same loss from the gathered tensors, so the all-gather's backward
keeps this rank's slice, pre-scaled by sp for the average over the dp x sp ranks that the Trainer's DDP
takes (:mod:`seqpar.batch.loss`'s convention). Metrics: TRL gathers them over every process, which
would count each SP copy once more (``num_tokens``) and round its float32 means differently; while its
``compute_loss`` runs, its accelerator's ``gather`` / ``gather_for_metrics`` gather over the dp ranks
only (:class:`DPGather`), as the script without seqpar does over its processes.

What seqpar cannot make exact is a :class:`~seqpar.errors.Refused` naming the option
(:func:`check_trl_options`). GRPO's generation runs the whole prompt on every rank with the plain model
(the model is parallelized only for the training forward), so every SP group trains on the completions
the script without seqpar samples from the same seed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...attention.layout import inverse_permutation
from ...batch.local_batch import BATCH_KWARG, LocalBatch
from ...batch.loss import ScaleGrad
from ...batch.sharding import shard_batch
from ...comm.gather import gather_seq
from ...comm.mesh import Axis, axis_group
from ...errors import Refused

FUSED_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""The per-token fields of TRL's fused LM head output (``FusedCausalLMOutput``)."""

class ShardedModel:
    """Stands in for the model while TRL's ``compute_loss`` runs: called with TRL's whole batch, it
    runs ``model`` (parallelized over ``mesh``) on this rank's shard and returns whole-batch outputs,
    the same on every SP rank (see the module doc). ``fused_lm_head=True`` calls return TRL's
    per-token fields ``[B, S-1]``; other calls return a sequence-classification model's score of
    each row's last non-padding token ``[B, K]`` (transformers' rule, ``pad_token_id``), or a causal
    LM's logits ``[B, S, V]`` (DPO's ``return_outputs``, for evaluation: no tiling).
    ``unread``: batch columns the trainer passes to the model, which the model does not read
    (RewardTrainer's ``margin``); any other input it cannot shard is Refused."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, layout: str, *, unread: tuple[str, ...] = ()) -> None:
        self.model, self.mesh, self.layout, self.unread = model, mesh, layout, unread
        self.group = axis_group(mesh, Axis.SP.value)

    def __call__(self, *, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                 fused_lm_head: bool = False, use_cache: bool | None = None, **extra: Any) -> Any:
        extra = {k: v for k, v in extra.items() if k not in self.unread}  # the trainer's, passed along: unread
        if extra:
            raise Refused(f"seqpar's TRL integration cannot shard the model inputs {sorted(extra)} (vision-language "
                          "or MoE router inputs of a preference / RL trainer): train a text model, or without seqpar")
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if fused_lm_head:
            return self._fused(batch, labels)
        if labels is not None:
            raise Refused("seqpar's TRL integration runs TRL's fused LM head or a score head, not the model's own "
                          "loss")
        return self._scores(batch) if score_module(self.model, required=False) is not None else self._logits(batch)

    def _fused(self, batch: dict[str, Tensor | None], labels: Tensor | None) -> Any:
        if labels is None:
            raise ValueError("TRL's fused LM head needs labels")
        local = shard_batch({**batch, "labels": labels}, self.mesh, layout=self.layout)
        targets = local.pop("labels")  # [B, S/P] already shifted: TRL's head must not shift again
        local.pop("shift_labels", None)
        out = self.model(**local, shift_labels=targets, fused_lm_head=True)
        fields = {name: self._whole(getattr(out, name), local[BATCH_KWARG])[:, :-1].contiguous()
                  for name in FUSED_FIELDS if getattr(out, name, None) is not None}
        return type(out)(**fields)  # loss / aux_loss left out: TRL's trainers here do not read them

    def _logits(self, batch: dict[str, Tensor | None]) -> Any:
        local = shard_batch(batch, self.mesh, layout=self.layout)
        local.pop("labels", None)
        local.pop("shift_labels", None)
        out = self.model(**local)
        out.logits = self._whole(out.logits, local[BATCH_KWARG])  # [B, S, V]
        return out

    def _scores(self, batch: dict[str, Tensor | None]) -> Any:
        head = score_module(self.model)
        caught: list[Tensor] = []
        handle = head.register_forward_hook(lambda _m, _a, out: caught.append(out))  # [B, S/P, K]
        try:
            local = shard_batch(batch, self.mesh, layout=self.layout)
            local.pop("labels", None)
            local.pop("shift_labels", None)
            out = self.model(**local)
        finally:
            handle.remove()
        if len(caught) != 1:
            raise Refused(f"{type(out).__name__}: its score head ran {len(caught)} times in one forward")
        scores = self._whole(caught[0], local[BATCH_KWARG])  # [B, S, K]
        rows = torch.arange(scores.shape[0], device=scores.device)
        out.logits = scores[rows, last_non_pad(batch["input_ids"], _pad_token_id(self.model)).to(scores.device)]
        return out

    def _whole(self, x: Tensor, batch: LocalBatch) -> Tensor:
        """``[B, S/P, ...] -> [B, S, ...]`` in the original token order; the gradient keeps this
        rank's slice, times sp (every rank computes the same loss from the whole tensor)."""
        p = len(batch.shard.seq_lens)
        if x.requires_grad:
            x = ScaleGrad.apply(x, float(p))
        full = gather_seq(x, dim=1, group=self.group, sizes=batch.shard.seq_lens, grad="slice")
        if batch.shard.positions is not None:
            full = full.index_select(1, inverse_permutation(batch.shard.positions).to(full.device))
        return full


class DPGather:
    """Stands in for the trainer's accelerator while TRL's ``compute_loss`` runs: ``gather`` and
    ``gather_for_metrics`` concatenate, ``reduce`` reduces, over the dp ranks only (one copy of each SP group's equal
    values; with dp=1 the tensor itself, as accelerate returns it in one process); every other
    attribute is the accelerator's."""

    def __init__(self, accelerator: Any, mesh: DeviceMesh, dp: int) -> None:
        self._accelerator, self._dp = accelerator, dp
        self._group = axis_group(mesh, Axis.DP.value) if dp > 1 else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def gather(self, tensor: Tensor) -> Tensor:
        if self._group is None:
            return tensor
        t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach().contiguous()
        parts = [torch.empty_like(t) for _ in range(self._dp)]
        dist.all_gather(parts, t, group=self._group)
        return torch.cat(parts)

    def reduce(self, tensor: Tensor, reduction: str = "sum", scale: float = 1.0) -> Tensor:
        """accelerate's ``reduce`` over the dp ranks only (TRL's token-weighted metric means: a sum of
        each SP group's one copy, in the order the script's processes sum them)."""
        if not isinstance(tensor, Tensor) or reduction not in ("sum", "mean", "max"):
            raise Refused("seqpar's TRL integration reduces one tensor by sum, mean or max")
        out = tensor.detach().clone()
        if self._group is not None:
            dist.all_reduce(out, op=dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM, group=self._group)
        return out / self._dp if reduction == "mean" else out

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        if use_gather_object or not isinstance(input_data, Tensor):
            raise Refused("seqpar's TRL integration gathers tensor metrics only")
        return self.gather(input_data)


def last_non_pad(input_ids: Tensor, pad_token_id: int | None) -> Tensor:
    """Each row's last token that is not ``pad_token_id`` ``[B]``: the token transformers'
    ``*ForSequenceClassification`` reads its score at (the last token when there is no pad id)."""
    if pad_token_id is None:
        return torch.full(input_ids.shape[:1], input_ids.shape[1] - 1, dtype=torch.long, device=input_ids.device)
    keep = (input_ids != pad_token_id).to(torch.long)
    return (torch.arange(input_ids.shape[1], device=input_ids.device) * keep).argmax(-1)


def score_module(model: nn.Module, *, required: bool = True) -> nn.Module | None:
    """The score head (``score`` / ``classifier``) of a sequence-classification model, inside any
    wrapper; without one, None or (``required``) Refused."""
    inner = _inner(model)
    for name in ("score", "classifier"):
        head = getattr(inner, name, None)
        if isinstance(head, nn.Module):
            return head
    if not required:
        return None
    raise Refused(f"{type(inner).__name__} has no score / classifier head: seqpar's RewardTrainer integration "
                  "trains an AutoModelForSequenceClassification")


def _pad_token_id(model: nn.Module) -> int | None:
    config = _inner(model).config
    return getattr(config, "pad_token_id", None)


def _inner(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP and peft wrappers."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


@contextlib.contextmanager
def swapped(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name = value`` for the block, restored after."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)
