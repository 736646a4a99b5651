"""What an objective takes from the model, per token, on this rank's shard: the final hidden state,
and from it the log-probability of each target and the entropy of each position -- one vocabulary
tile at a time, never the ``[S, V]`` logits (the machinery of :mod:`seqpar.batch.tiled_loss`)::

    hidden   # [N, H]     (N = B * S_local tokens, flattened)
      forward, per tile of T tokens:  z = head(h) / temperature     # [T, V], one buffer, dies with the tile
          s = z - max_v z,  e = exp(s) in place,  Z = sum e,  then e log e in place
          logp_i = s_i[target_i] - log Z_i        entropy_i = log Z_i - sum_v e_iv s_iv / Z_i
      backward, per tile (z recomputed; both gradients arrive per token):
          dz = g_logp * (onehot - p) - g_ent * p * (log p + entropy)      # in z's buffer
          grad_h[tile] = chain(dz) @ W,   grad_W += chain(dz)^T @ h

How many tokens a tile holds, unless the caller says (:func:`seqpar.batch.tiles.vocab_tile`): as
many as keep the tile's ``[T, V]`` buffer within half of what the shard's own hidden states
``[N, H]`` hold, so that the vocabulary never dominates a rank's memory and that memory shrinks with
the shard (sp), between :data:`~seqpar.batch.tiles.MIN_TILE` and the model's ``loss_tile``
(:func:`seqpar.reduce_memory`; 1024 without it).

A vocabulary-parallel head (tensor parallelism: each tp rank holds rows ``vocab_start ..`` of the
head, ``z [T, V/tp]``) makes the same tiles on its own rows and reduces over tp what spans the whole
vocabulary (Megatron's vocab-parallel cross entropy, :mod:`seqpar.batch.vocab_parallel`)::

    m         = all-reduce MAX of the tile's row maxima                       # [T]
    Z, E, t   = all-reduce SUM of (sum e, sum e s, s[target] or 0)            # [3, T], one buffer
    backward: dz on this rank's rows only (p = exp(z - lse) is local); the hidden states' gradient,
              a partial sum over the ranks' rows, all-reduced over tp (the head's column style would)

so no rank holds more than ``[T, V/tp]``, and the results are the same on every tp rank.

A per-token value or score (a value head, a sequence-classification head) is the model's own small
head on the hidden state: ``[B, S_local, K]`` with K the number of labels.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..batch.local_batch import BATCH_KWARG
from ..batch.targets import IGNORE_INDEX
from ..batch.tiled_loss import Head, accumulate_product, check_tile, sum_over_tp, token_tiles
from ..batch.tiles import DEFAULT_LOSS_TILE
from ..batch.vocab_parallel import local_targets as vocab_targets
from ..comm import collectives
from ..errors import Refused
from ..integrations.memory.tiled_head import last_hidden
from ..integrations.peft import unwrap_peft
from ..integrations.state import state_of

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


ROW_BLOCKS = 8
"""The backward's elementwise pass runs over ``1/ROW_BLOCKS`` of a tile's rows at a time (see
:class:`_TiledTokenStats`): its temporaries are an eighth of the tile."""


class _TiledTokenStats(torch.autograd.Function):
    """Forward: per-token ``log p(target)`` and entropy, tile by tile (see the module doc). Backward:
    the gradients arrive per token, so each tile's logits are recomputed and differentiated at once;
    the weight's gradient is accumulated across the tiles. One ``[T, V]`` buffer of one tile is
    alive at a time, never ``[S, V]``: the forward reduces it in place (shift, exp, ``e log e``), the
    backward builds the gradient in it, a block of ``T / ROW_BLOCKS`` rows at a time (the block's
    ``p``, and with a softcap its slope, are the only other ``[., V]`` tensors). A bfloat16 model's
    logits are made in bfloat16 and widened, its gradient narrowed back for the matmuls: half a
    buffer more at those two moments."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, head: Head, targets: Tensor,
                temperature: float, tile: int, ignore_index: int) -> tuple[Tensor, Tensor]:
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        logps, ents, lses = [], [], []
        for a, b in token_tiles(hidden.shape[0], tile):
            z = _tile_logits(head, hidden[a:b], temperature)  # [T, V] (V/tp: this rank's rows), one buffer
            valid = targets[a:b] != ignore_index
            top, picked, total, e_s = _tile_sums(z, torch.where(valid, targets[a:b], -1), head)
            del z  # consumed: freed before the next tile's buffer is made (one tile alive, not two)
            log_total = total.log()
            logps.append((picked - log_total) * valid)
            ents.append(log_total - e_s / total)  # -sum p log p = log Z - sum e s / Z
            lses.append(top + log_total)
        empty = hidden.new_zeros(0, dtype=cdtype)
        logp, ent = (torch.cat(logps) if logps else empty), (torch.cat(ents) if ents else empty)  # [N], [N]
        ctx.set_materialize_grads(False)  # an output nobody used: None, not a [N] of zeros to chain back
        ctx.save_for_backward(hidden, targets, torch.cat(lses) if lses else empty, ent)
        ctx.head, ctx.temperature, ctx.tile, ctx.ignore_index = head, temperature, tile, ignore_index
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None):
        hidden, targets, lse, ent = ctx.saved_tensors
        head, weight, bias = ctx.head, ctx.head.weight, ctx.head.bias
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device)  # [V, H]
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=cdtype, device=bias.device)
        for a, b in token_tiles(hidden.shape[0], ctx.tile):
            h = hidden[a:b]
            g = None if g_logp is None else g_logp[a:b].to(cdtype) * (targets[a:b] != ctx.ignore_index)  # [T]
            ge = None if g_ent is None else g_ent[a:b].to(cdtype)  # [T]
            # the target's column among this rank's rows (a vocabulary-parallel head: where it is one of them)
            idx, here = vocab_targets(targets[a:b], head.vocab_start, max(weight.shape[0], 1))
            dz = _tile_grad(head, h, idx[:, None], lse[a:b], ent[a:b], g, ge, ctx.temperature,
                            None if head.tp_group is None else here)
            dz = dz.to(hidden.dtype)  # [T, V], the model's dtype, as autograd would
            grad_h[a:b] = dz @ weight
            accumulate_product(grad_w, dz.t(), h)
            if grad_b is not None:
                grad_b += dz.sum(0).to(cdtype)
            del dz
        sum_over_tp(grad_h, head)  # vocabulary-parallel: each rank's rows gave a part of it
        return (grad_h, grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None, None)


def _tile_sums(z: Tensor, targets: Tensor, head: Head) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(m, s[target], Z, sum e s)`` ``[T]`` each, of one tile's logits ``z [T, V]`` (consumed in
    place): ``s = z - m`` with ``m`` the row maximum, ``e = exp(s)``, ``Z = sum e``; ``targets`` -1
    where ignored (``s[target]`` 0 there). A vocabulary-parallel head's rows: ``m`` the maximum over
    every tp rank's, the three sums over them too (module doc: two all-reduces)."""
    group = head.tp_group
    width = z.shape[1]
    idx, here = vocab_targets(targets, head.vocab_start if group is not None else 0, max(width, 1))
    top = z.amax(1) if width else z.new_full((z.shape[0],), float("-inf"))  # [T]
    if group is not None:
        collectives.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = z.sub_(top[:, None])  # s = z - max
    picked = shifted.gather(1, idx[:, None]).squeeze(1) * here if width else z.new_zeros(z.shape[0])  # [T]
    e = shifted.exp_()  # e = exp(s)
    sums = torch.stack([e.sum(1), e.xlogy_(e).sum(1), picked])  # [3, T]: Z, sum e * s (log e = s), s[target]
    del z, shifted, e
    if group is not None:
        collectives.all_reduce(sums, group=group)
    total, e_s, picked = sums.unbind(0)
    return top, picked, total, e_s


def _tile_logits(head: Head, h: Tensor, temperature: float) -> Tensor:
    """One tile's ``head(h) / temperature`` ``[T, V]`` in compute dtype (float32 at least), made in
    one buffer: the head's scaling, softcap and the temperature applied in place."""
    z = head.logits_(h)  # [T, V]
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z.div_(temperature) if temperature != 1.0 else z


def _tile_grad(head: Head, h: Tensor, target: Tensor, lse: Tensor, ent: Tensor, g_logp: Tensor | None,
               g_ent: Tensor | None, temperature: float, here: Tensor | None = None) -> Tensor:
    """``d(sum g_logp * logp + g_ent * entropy) / d(h @ W^T + b)`` ``[T, V]`` in compute dtype, built
    in the buffer of the tile's recomputed logits (``lse``, ``ent``: the forward's ``[T]``, over the
    whole vocabulary; ``here``: a vocabulary-parallel shard's mask of the rows whose target is one of
    its columns ``target``, None for a whole head)::

        dz = g_logp * (onehot - p) - g_ent * p * (log p + entropy)
           = -p * (k + g_ent * log p) + g_logp * onehot,     k = g_logp + g_ent * entropy

    then back through the temperature and the head (softcap slope ``1 - (z / softcap)^2``, divide,
    scale). ``p`` and the slope exist for one block of rows at a time (:data:`ROW_BLOCKS`)."""
    logp = _tile_logits(head, h, temperature).sub_(lse[:, None])  # [T, V]: log p, the tile's one buffer
    zero = logp.new_zeros(())
    k = (zero if g_logp is None else g_logp) + (zero if g_ent is None else g_ent * ent)  # [T] (or a scalar 0)
    k = k.expand(logp.shape[0])
    rows = -(-logp.shape[0] // ROW_BLOCKS)
    for r in range(0, logp.shape[0], rows):
        block, sl = logp[r:r + rows], slice(r, r + rows)  # [R, V], a view
        p = block.exp()  # [R, V]
        slope = None
        if head.softcap is not None:  # 1 - tanh^2, tanh = z / softcap, z = (log p + lse) * temperature
            slope = (block + lse[sl, None]).mul_(temperature / head.softcap).square_().neg_().add_(1)
        if g_ent is not None:
            block.mul_(g_ent[sl, None]).add_(k[sl, None])
        else:
            block.copy_(k[sl, None].expand_as(block))
        block.mul_(p).neg_()
        del p
        if g_logp is not None and block.shape[1]:  # (a vocabulary-parallel rank may hold no row)
            onehot = g_logp[sl] if here is None else g_logp[sl] * here[sl]
            block.scatter_add_(1, target[sl], onehot[:, None])
        if temperature != 1.0:
            block.div_(temperature)
        if slope is not None:
            block.mul_(slope)
        del slope
    dz = logp
    if head.divide is not None:
        dz.div_(head.divide)
    if head.scale is not None:
        dz.mul_(head.scale)
    return dz


def token_logps_entropy(hidden: Tensor, head: Head, targets: Tensor, *, temperature: float = 1.0,
                        tile: int = 1024, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """``(log p(target) [B, S], entropy [B, S])`` of ``head(hidden) / temperature``, differentiable,
    one tile of ``tile`` tokens at a time (no ``[S, V]`` logits). ``hidden [B, S, H]``, ``targets
    [B, S]`` already shifted; the log-probability is 0 where the target is ignored, the entropy is
    every position's. In float32 at least. A vocabulary-parallel head (``head.tp_group``: tensor
    parallelism) reduces over tp (module doc): every rank of the tp group calls this together and
    gets the same values. Raises ValueError for a bad tile or temperature."""
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
