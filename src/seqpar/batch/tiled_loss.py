"""The causal-LM loss from the final hidden states, in sequence tiles: no ``[S, V]`` logits tensor.

With a real vocabulary the full logits and their gradient dominate a long sequence's memory (a
32k vocabulary in float32 is 128 KiB per token, twice). Here the head (``hidden @ W^T``, its bias,
logit scaling and final-logit softcapping) and the cross entropy run ``tile`` tokens at a time::

    hidden   # [N, H]     (N = B * S_local tokens, flattened)
      for each tile of T tokens:
        z      = head(hidden[tile])        # [T, V]   in the model's dtype, as the model computes it
        loss  += sum w_i * CE(z_i, t_i)    #          in float32 at least (float64 stays float64)
        dz     = w * (softmax(z) - onehot)     # d loss / d z, chained back through softcap / scale
        grad_h[tile] = dz @ W              # [T, H]
        grad_W      += dz^T @ hidden[tile] # [V, H]   accumulated across tiles
      (the tile's [T, V] tensors die here)

The gradient of a scalar loss needs nothing from later tiles, so it is computed in the forward,
inside each tile, and the backward only scales it by the incoming gradient: the same three matmuls
as the untiled forward + backward, no second pass. Peak extra memory: a few ``[T, V]`` buffers plus
``grad_h [N, H]`` and ``grad_W [V, H]``. Values and gradients equal :func:`seqpar.batch.loss.token_losses`
on the model's logits to rounding.

:func:`tiled_log_probs` (per-token log-probabilities, a vector whose gradient is not known in the
forward) recomputes each tile's logits in its backward instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..attention.shard import SeqShard
from ..comm import collectives
from ..comm.guard import check_failures
from ..comm.mesh import Axis, as_mesh, axis_group
from .local_batch import LocalBatch
from .loss import gather_token_values, labels_and_shard
from .targets import IGNORE_INDEX
from .vocab_parallel import local_targets, vocab_parallel_terms


@dataclass(frozen=True)
class Head:
    """How a model turns its final hidden states into logits, in its own order of operations:
    ``z = hidden @ weight^T (+ bias)``; then ``z * scale`` (Cohere's ``logit_scale``), ``z / divide``
    (Granite's ``logits_scaling``); then ``tanh(z / softcap) * softcap`` (Gemma 2's
    ``final_logit_softcapping``). ``weight [V, H]``, ``bias [V]`` or None.

    A vocabulary-parallel head (tensor parallelism) holds rows ``vocab_start ..`` of the head on each
    rank of ``tp_group`` (``weight [V/tp, H]``): the tiles' log-sum-exp and target logits reduce over
    it (:mod:`.vocab_parallel`), and the hidden states' gradient, a partial sum, is all-reduced."""

    weight: Tensor
    bias: Tensor | None = None
    scale: float | None = None
    divide: float | None = None
    softcap: float | None = None
    tp_group: dist.ProcessGroup | None = None
    vocab_start: int = 0

    def logits(self, h: Tensor) -> Tensor:
        """``h [T, H] -> z [T, V]`` in the model's dtype, and ``tanh`` of the softcap (or None)."""
        z = torch.nn.functional.linear(h, self.weight, self.bias)
        if self.scale is not None:
            z = z * self.scale
        if self.divide is not None:
            z = z / self.divide
        t = None
        if self.softcap is not None:
            t = torch.tanh(z / self.softcap)
            z = t * self.softcap
        return z, t

    def logits_(self, h: Tensor) -> Tensor:
        """:meth:`logits` with the scaling and the softcap applied in place: ``z [T, V]`` in the model's
        dtype, one buffer, the same values (the same operations in the same order). The softcap's
        ``tanh`` is not kept: it is ``z / softcap``."""
        z = torch.nn.functional.linear(h, self.weight, self.bias)
        if self.scale is not None:
            z.mul_(self.scale)
        if self.divide is not None:
            z.div_(self.divide)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z

    def chain(self, dz: Tensor, t: Tensor | None) -> Tensor:
        """d loss / d (hidden @ W^T + b) from d loss / d z: back through softcap, divide, scale."""
        if t is not None:
            dz = dz * (1 - t.to(dz.dtype) ** 2)  # d(c * tanh(u / c)) / du = 1 - tanh^2
        if self.divide is not None:
            dz = dz / self.divide
        if self.scale is not None:
            dz = dz * self.scale
        return dz


def check_tile(tile: int, option: str) -> None:
    """Raise ValueError unless ``tile`` is a positive int (``option`` names the argument to change)."""
    if isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0:
        raise ValueError(f"{option}={tile!r}: a tile is a positive number of tokens (e.g. {option}=1024)")


def token_tiles(n: int, tile: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of ``n`` tokens in tiles of ``tile``."""
    return [(a, min(a + tile, n)) for a in range(0, n, tile)]


def _tile_terms(head: Head, h: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """One tile: ``(per-token CE [T], logits z [T, V] in compute dtype, their logsumexp [T], valid [T],
    tanh or None)``."""
    z, t = head.logits(h)
    zc = z.to(torch.promote_types(z.dtype, torch.float32))  # token_losses' compute dtype
    valid = target != ignore_index
    if head.tp_group is not None:  # this rank's vocabulary rows: lse and the target's logit over tp
        lse, picked, _ = vocab_parallel_terms(zc, torch.where(valid, target, -1), head.vocab_start, head.tp_group)
    else:
        picked = zc.gather(1, target.clamp(min=0)[:, None]).squeeze(1)
        lse = _logsumexp_rows(zc)
    ce = (lse - picked) * valid
    if weight is not None:
        ce = ce * weight.to(ce.dtype)
    return ce, zc, lse, valid, t


LSE_ROWS = 128
"""Rows per ``logsumexp`` call of a tile: torch's CPU logsumexp makes a temporary as large as its
input (``exp(z - max)``), which for a whole ``[T, V]`` tile doubled the loss's peak; per row it is
the same reduction, so the same values."""


def _logsumexp_rows(z: Tensor) -> Tensor:
    """``torch.logsumexp(z, dim=1)`` of ``z [T, V]``, :data:`LSE_ROWS` rows at a time."""
    if z.shape[0] <= LSE_ROWS:
        return torch.logsumexp(z, dim=1)
    return torch.cat([torch.logsumexp(z[i:i + LSE_ROWS], dim=1) for i in range(0, z.shape[0], LSE_ROWS)])


def _dlogits(zc: Tensor, lse: Tensor, target: Tensor, row_scale: Tensor, start: int = 0) -> Tensor:
    """``row_scale * (softmax(z) - onehot(target))`` ``[T, V]``, in place in ``zc`` (its last use):
    one ``[T, V]`` buffer per tile instead of three. ``start``: the first vocabulary row ``zc``
    holds (a vocabulary-parallel shard: the onehot only where the target is one of its rows)."""
    dz = zc.sub_(lse[:, None]).exp_()
    idx, here = local_targets(target, start, dz.shape[1])
    dz.scatter_add_(1, idx[:, None], -here.to(dz.dtype)[:, None])
    return dz.mul_(row_scale[:, None])


def sum_over_tp(grad_h: Tensor | None, head: Head) -> None:
    """A vocabulary-parallel head's hidden-state gradient is a partial sum over its tp ranks' rows:
    all-reduced in place (what the head's column style does for the untiled head)."""
    if grad_h is not None and head.tp_group is not None:
        collectives.all_reduce(grad_h, group=head.tp_group)


def accumulate_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` (``[V, T] @ [T, H]``), in place when the dtypes allow (no ``[V, H]`` temporary)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:  # a bfloat16 model's tile product, summed in float32
        acc += (a @ b).to(acc.dtype)


class _TiledLoss(torch.autograd.Function):
    """Forward: ``sum_i w_i * CE_i`` over all tokens, tile by tile, each tile's gradient w.r.t. the
    hidden states, weight and bias computed in the tile (see the module doc). Backward: those
    gradients times the incoming scalar gradient -- the loss is linear in its incoming gradient, so
    precomputing ``d sum / d inputs`` is exact; nothing is recomputed."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, head: Head, targets: Tensor,
                token_weights: Tensor | None, tile: int, ignore_index: int, grads: bool) -> Tensor:
        # hidden [N, H], targets [N], token_weights [N] or None; grads: whether autograd records this call
        need_h, need_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        need_b = grads and bias is not None and ctx.needs_input_grad[2]
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        total = hidden.new_zeros((), dtype=cdtype)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device) if need_w else None  # [V, H]
        grad_b = torch.zeros(bias.shape, dtype=cdtype, device=bias.device) if need_b else None
        for a, b in token_tiles(hidden.shape[0], tile):
            h = hidden[a:b]  # [T, H]
            w = None if token_weights is None else token_weights[a:b]
            ce, zc, lse, valid, t = _tile_terms(head, h, targets[a:b], w, ignore_index)
            total += ce.sum()
            if need_h or need_w or need_b:
                scale = valid.to(cdtype) if w is None else valid * w.to(cdtype)
                dz = _dlogits(zc, lse, targets[a:b], scale, head.vocab_start)  # [T, V]: d CE / d z = softmax - onehot
                dz = head.chain(dz, t).to(hidden.dtype)  # the model's dtype, as autograd would
                if need_h:
                    grad_h[a:b] = dz @ weight
                if need_w:
                    accumulate_product(grad_w, dz.t(), h)
                if need_b:
                    grad_b += dz.sum(0).to(cdtype)
                del dz
            del zc, t  # this tile's [T, V] buffers die before the next tile's are made (one tile alive, not two)
        sum_over_tp(grad_h, head)
        ctx.grads = (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                     None if grad_b is None else grad_b.to(bias.dtype))
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        gh, gw, gb = ctx.grads
        del ctx.grads
        scale = grad.to(gh.dtype if gh is not None else gw.dtype if gw is not None else gb.dtype)
        # in place: the buffers are this call's own (ctx let go of them), so no second [N, H] / [V, H] copy
        return (None if gh is None else gh.mul_(scale), None if gw is None else gw.mul_(scale),
                None if gb is None else gb.mul_(scale), None, None, None, None, None, None)


def tiled_loss_sum(hidden: Tensor, head: Head, targets: Tensor, *, token_weights: Tensor | None = None,
                   tile: int = 1024, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``sum_i w_i * CE(head(hidden_i), targets_i)`` as a differentiable scalar, ``tile`` tokens at a
    time (see the module doc). ``hidden [B, S, H]``, ``targets [B, S]`` (already shifted; ``ignore_index``
    contributes 0), ``token_weights [B, S]`` or None. The sum is in float32 at least. Raises
    ValueError for a non-positive tile."""
    check_tile(tile, "loss_tile")
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    weights = None if token_weights is None else token_weights.reshape(-1).to(flat.device)
    return _TiledLoss.apply(flat, head.weight, head.bias, head, targets.reshape(-1).to(flat.device), weights,
                            tile, ignore_index, torch.is_grad_enabled())


@torch.no_grad()
def tiled_token_stats(hidden: Tensor, head: Head, targets: Tensor, *, tile: int = 1024,
                      ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Evaluation without the logits: ``(per-token CE [B, S], correct [B, S] bool)`` where
    ``correct`` says the argmax of the logits is the target (False where ignored), ``tile`` tokens
    at a time, no gradient. ``hidden [B, S, H]``, ``targets [B, S]`` already shifted."""
    check_tile(tile, "loss_tile")
    flat, tflat = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1).to(hidden.device)
    ces, hits = [], []
    for a, b in token_tiles(flat.shape[0], tile):
        ce, zc, _, valid, _ = _tile_terms(head, flat[a:b], tflat[a:b], None, ignore_index)
        ces.append(ce)
        hits.append((_argmax(zc, head) == tflat[a:b]) & valid)
    if not ces:
        return flat.new_zeros(targets.shape), torch.zeros(targets.shape, dtype=torch.bool, device=flat.device)
    return torch.cat(ces).view(targets.shape), torch.cat(hits).view(targets.shape)


def _argmax(zc: Tensor, head: Head) -> Tensor:
    """``zc.argmax(1)`` over the whole vocabulary: for a vocabulary-parallel shard, the lowest
    global row holding the maximum (argmax's tie rule), by two all-reduces over tp."""
    if head.tp_group is None:
        return zc.argmax(1)
    best = zc.max(1).values if zc.shape[1] else zc.new_full((zc.shape[0],), float("-inf"))
    top = best.clone()
    collectives.all_reduce(top, op=dist.ReduceOp.MAX, group=head.tp_group)
    none = torch.iinfo(torch.long).max
    first = torch.where(best == top, zc.argmax(1) + head.vocab_start if zc.shape[1] else top.long(),
                        torch.full_like(top, none, dtype=torch.long))
    collectives.all_reduce(first, op=dist.ReduceOp.MIN, group=head.tp_group)
    return first


class _TiledLogProbs(torch.autograd.Function):
    """Forward: the log-probability of each target, tile by tile. Backward: the incoming gradient is
    per token, so the tiles' logits are recomputed: ``d logp_i / d z = onehot - softmax``, chained
    back through the head, into ``hidden`` and the weight (accumulated across tiles)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, head: Head, targets: Tensor,
                tile: int, ignore_index: int) -> Tensor:
        out = torch.cat([-ce for ce, *_ in (_tile_terms(head, hidden[a:b], targets[a:b], None, ignore_index)
                                            for a, b in token_tiles(hidden.shape[0], tile))]) \
            if hidden.shape[0] else hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        ctx.save_for_backward(hidden, targets)
        ctx.head, ctx.tile, ctx.ignore_index = head, tile, ignore_index
        return out  # [N]

    @staticmethod
    def backward(ctx, grad: Tensor):
        hidden, targets = ctx.saved_tensors
        head, weight, bias = ctx.head, ctx.head.weight, ctx.head.bias
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=cdtype, device=weight.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=cdtype, device=bias.device)
        for a, b in token_tiles(hidden.shape[0], ctx.tile):
            h = hidden[a:b]
            _, zc, lse, valid, t = _tile_terms(head, h, targets[a:b], None, ctx.ignore_index)
            # d logp / dz = onehot - softmax, times the incoming per-token gradient
            dz = head.chain(_dlogits(zc, lse, targets[a:b], -grad[a:b].to(cdtype) * valid, head.vocab_start),
                            t).to(hidden.dtype)
            grad_h[a:b] = dz @ weight
            accumulate_product(grad_w, dz.t(), h)
            if grad_b is not None:
                grad_b += dz.sum(0).to(cdtype)
        sum_over_tp(grad_h, head)
        return (grad_h, grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype),
                None, None, None, None)


def tiled_log_probs(hidden: Tensor, head: Head, targets: Tensor, *, tile: int = 1024,
                    ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Per-token ``log p(target)`` ``[B, S]`` (0 where ignored), differentiable, without the
    ``[S, V]`` logits: each tile's logits are recomputed in the backward. ``hidden [B, S, H]``,
    ``targets [B, S]`` already shifted."""
    check_tile(tile, "loss_tile")
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = _TiledLogProbs.apply(flat, head.weight, head.bias, head, targets.reshape(-1).to(flat.device), tile,
                               ignore_index)
    return out.view(targets.shape)


def tiled_gather_log_probs(hidden: Tensor, head: Head, labels: Tensor | dict[str, Any], mesh: DeviceMesh, *,
                           shard: SeqShard | LocalBatch | None = None, tile: int = 1024,
                           ignore_index: int = IGNORE_INDEX) -> Tensor:
    """:func:`seqpar.gather_log_probs` from the final hidden states ``[B, S_local, H]`` and the head
    (:func:`seqpar.integrations.memory.tiled_head.output_head`) instead of the logits: ``[B, S]`` per-token
    log-probabilities on every SP rank, differentiable, with no ``[S_local, V]`` tensor."""
    labels, shard = labels_and_shard(labels, shard)
    group = axis_group(as_mesh(mesh, "tiled_gather_log_probs"), Axis.SP.value)
    check_failures(group)  # as gather_log_probs: nothing from a failed forward
    picked = tiled_log_probs(hidden, head, labels, tile=tile, ignore_index=ignore_index)  # [B, S_local]
    return gather_token_values(picked, group, shard)
