"""What an objective takes from the model, per token, on this rank's shard: the final hidden state,
and from it the log-probability of each target and the entropy of each position -- one vocabulary
tile at a time, never the ``[S, V]`` logits (the machinery of :mod:`seqpar.batch.tiled_loss`)::

    hidden   # [N, H]     (N = B * S_local tokens, flattened)
      forward, per tile of T tokens:  z = head(h) / temperature     # [T, V], dies with the tile
          logp_i = z_i[target_i] - lse_i          entropy_i = lse_i - sum_v softmax(z_i)_v z_iv
      backward, per tile (z recomputed; both gradients arrive per token):
          dz = g_logp * (onehot - p) - g_ent * p * (log p + entropy)
          grad_h[tile] = chain(dz) @ W,   grad_W += chain(dz)^T @ h

How many tokens a tile holds, unless the caller says (:func:`vocab_tile`): as many as keep the tile's
two ``[T, V]`` buffers within what the shard's own hidden states ``[N, H]`` hold, so that the
vocabulary never dominates a rank's memory and that memory shrinks with the shard (sp), between
:data:`MIN_TILE` and the model's ``loss_tile`` (:func:`seqpar.reduce_memory`; 1024 without it).

A per-token value or score (a value head, a sequence-classification head) is the model's own small
head on the hidden state: ``[B, S_local, K]`` with K the number of labels.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from ..batch.local_batch import BATCH_KWARG
from ..batch.targets import IGNORE_INDEX
from ..batch.tiled_loss import Head, accumulate_product, check_tile, token_tiles
from ..batch.tiles import DEFAULT_LOSS_TILE
from ..errors import Refused
from ..integrations.peft import unwrap_peft
from ..integrations.state import state_of
from ..integrations.tiled_head import last_hidden

_NOT_MODEL_KEYS = ("labels", "shift_labels")


def model_tile(model: nn.Module) -> int:
    """The model's ``loss_tile`` when :func:`seqpar.reduce_memory` is on, else :data:`DEFAULT_LOSS_TILE`."""
    records = (state_of(model), state_of(unwrap_peft(model)))  # a peft model's record may be its own
    memory = next((r.memory for r in records if r is not None and r.memory is not None), None)
    return memory.loss_tile if memory is not None else DEFAULT_LOSS_TILE


def final_hidden(model: nn.Module, local: dict[str, Any]) -> tuple[Tensor, Any]:
    """``(hidden [B, S_local, H], the model's output)``: the model run on its shard, its base model's
    last hidden state caught by a forward hook. The model computes no loss (no labels) and, where
    its forward takes ``logits_to_keep``, the logits of one token only."""
    base = unwrap_peft(model).base_model
    if not isinstance(base, nn.Module) or base is unwrap_peft(model):
        raise Refused(f"{type(model).__name__} has no base model whose hidden states feed its head: seqpar's "
                      "objectives need a transformers model with a head (ForCausalLM, ForSequenceClassification)")
    caught: list[Tensor] = []
    handle = base.register_forward_hook(lambda _m, _a, out: caught.append(last_hidden(out)))
    kwargs = {k: v for k, v in local.items() if k not in _NOT_MODEL_KEYS}
    if "logits_to_keep" in inspect.signature(type(unwrap_peft(model)).forward).parameters:
        kwargs["logits_to_keep"] = 1  # the objective runs the head itself, tile by tile
    try:
        out = model(**kwargs)
    finally:
        handle.remove()
    if not caught:
        raise Refused(f"{type(model).__name__}'s forward did not run its base model")
    return caught[-1], out


def score_head(model: nn.Module) -> nn.Linear:
    """The small head of a sequence-classification / value model (``score`` or ``classifier``)."""
    inner = unwrap_peft(model)
    for name in ("score", "classifier"):
        head = getattr(inner, name, None)
        if isinstance(head, nn.Linear):
            return head
        if head is not None and isinstance(getattr(head, "base_layer", None), nn.Linear):
            return head  # a LoRA-wrapped head: its forward adds the adapter
    raise Refused(f"{type(model).__name__} has no score / classifier linear head: a sequence or value head "
                  "objective needs an AutoModelForSequenceClassification-style model")


class _TiledTokenStats(torch.autograd.Function):
    """Forward: per-token ``log p(target)`` and entropy, tile by tile (see the module doc). Backward:
    the gradients arrive per token, so each tile's logits are recomputed and differentiated at once;
    the weight's gradient is accumulated across the tiles. At most two ``[T, V]`` buffers of one tile
    are alive at a time (log p and p; the gradient is built in place in them), never ``[S, V]``."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, head: Head, targets: Tensor,
                temperature: float, tile: int, ignore_index: int) -> tuple[Tensor, Tensor]:
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        logps, ents = [], []
        for a, b in token_tiles(hidden.shape[0], tile):
            logp_all, _ = _tile_log_softmax(head, hidden[a:b], temperature)  # [T, V]
            valid = targets[a:b] != ignore_index
            logps.append(logp_all.gather(1, targets[a:b].clamp(min=0)[:, None]).squeeze(1) * valid)
            ents.append(_entropy(logp_all.exp(), logp_all))
            del logp_all  # the tile's buffers die before the next tile's are made
        empty = hidden.new_zeros(0, dtype=cdtype)
        ctx.set_materialize_grads(False)  # an output nobody used: None, not a [N] of zeros to chain back
        ctx.save_for_backward(hidden, targets)
        ctx.head, ctx.temperature, ctx.tile, ctx.ignore_index = head, temperature, tile, ignore_index
        return (torch.cat(logps) if logps else empty), (torch.cat(ents) if ents else empty)  # [N], [N]

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None):
        hidden, targets = ctx.saved_tensors
        head, weight, bias = ctx.head, ctx.head.weight, ctx.head.bias
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device)  # [V, H]
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=cdtype, device=bias.device)
        for a, b in token_tiles(hidden.shape[0], ctx.tile):
            h, target = hidden[a:b], targets[a:b].clamp(min=0)[:, None]
            g = None if g_logp is None else g_logp[a:b].to(cdtype) * (targets[a:b] != ctx.ignore_index)  # [T]
            dz, t = _tile_grad(head, h, target, g, None if g_ent is None else g_ent[a:b].to(cdtype),
                               ctx.temperature)
            dz = head.chain(dz, t).to(hidden.dtype)  # [T, V]
            grad_h[a:b] = dz @ weight
            accumulate_product(grad_w, dz.t(), h)
            if grad_b is not None:
                grad_b += dz.sum(0).to(cdtype)
            del dz, t
        return (grad_h, grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None, None)


def _tile_log_softmax(head: Head, h: Tensor, temperature: float) -> tuple[Tensor, Tensor | None]:
    """One tile: ``(log_softmax(head(h) / temperature) [T, V] in compute dtype, tanh or None)``; the
    logits are scaled in place and die inside ``log_softmax`` (two ``[T, V]`` buffers at its peak)."""
    z, t = head.logits(h)  # [T, V], a fresh tensor: scaling it in place touches nothing else
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if temperature != 1.0:
        z.div_(temperature)
    return torch.log_softmax(z, dim=1), t


def _entropy(p: Tensor, logp: Tensor) -> Tensor:
    """``-sum_v p log p`` per row ``[T]`` as a batched dot product: no third ``[T, V]`` buffer."""
    return -torch.bmm(p.unsqueeze(1), logp.unsqueeze(2)).view(-1)


def _tile_grad(head: Head, h: Tensor, target: Tensor, g_logp: Tensor | None, g_ent: Tensor | None,
               temperature: float) -> tuple[Tensor, Tensor | None]:
    """``(d(sum g_logp * logp + g_ent * entropy) / d(z / temperature) / temperature [T, V], tanh or None)``
    with ``z`` the tile's head output, built in place in the two buffers of log p and p::

        dz = g_logp * (onehot - p) - g_ent * p * (log p + entropy)
           = -p * (g_logp + g_ent * (log p + entropy)) + g_logp * onehot
    """
    logp, t = _tile_log_softmax(head, h, temperature)  # [T, V]
    p = logp.exp()  # [T, V]
    coef = logp  # [T, V], in place: log p is not needed after this
    if g_ent is not None:
        coef.add_(_entropy(p, logp)[:, None]).mul_(g_ent[:, None])
    else:
        coef.zero_()
    if g_logp is not None:
        coef.add_(g_logp[:, None])
    dz = p.mul_(coef).neg_()
    del coef, logp
    if g_logp is not None:
        dz.scatter_add_(1, target, g_logp[:, None])
    if temperature != 1.0:
        dz.div_(temperature)
    return dz, t


def token_logps_entropy(hidden: Tensor, head: Head, targets: Tensor, *, temperature: float = 1.0,
                        tile: int = 1024, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """``(log p(target) [B, S], entropy [B, S])`` of ``head(hidden) / temperature``, differentiable,
    one tile of ``tile`` tokens at a time (no ``[S, V]`` logits). ``hidden [B, S, H]``, ``targets
    [B, S]`` already shifted; the log-probability is 0 where the target is ignored, the entropy is
    every position's. In float32 at least. Raises ValueError for a bad tile or temperature."""
    check_tile(tile, "tile")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: the logits are divided by it; use a positive number")
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    logp, ent = _TiledTokenStats.apply(flat, head.weight, head.bias, head, targets.reshape(-1).to(flat.device),
                                       float(temperature), tile, ignore_index)
    return logp.view(targets.shape), ent.view(targets.shape)


def local_targets(local: dict[str, Any]) -> Tensor:
    """The shifted local targets ``[B, S_local]`` of a shard_batch result; ValueError without labels."""
    if local.get("labels") is None or BATCH_KWARG not in local:
        raise ValueError("an objective reads the completion tokens from the batch's labels (ignore_index "
                         "elsewhere): pass labels to seqpar.shard_batch")
    return local["labels"]
