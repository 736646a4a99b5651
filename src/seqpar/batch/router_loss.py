"""MoE router load-balancing losses, exact under sequence parallelism.

transformers' ``load_balancing_loss_func`` (Switch Transformer, eq. 4-6) over one forward's tokens
(padding left out), summed over the L router layers, E experts, top-k routing::

    f_e = (top-k assignments to e, every layer and kept token) / (L * T * c)     c: see ROUTER_RULES
    p_e = (softmax probability of e, every layer and kept token) / (L * T)
    aux = E * sum_e f_e * p_e

a product of batch means: the mean of per-shard products is not it (issue 36). Each SP rank sums
its own tokens; one all-reduce makes the sums the whole batch's *before* the product::

    rank r   gate logits [B*S_r, E] per layer  ->  sums_r = [probs_r (E, grad) | counts_r (E) | rows_r]
    all-reduce (sum) over sp                   ->  sums of the whole batch (every rank the same)
    aux = E * sum(counts / (rows * c) * probs / rows)           (the same value on every rank)

Gradient: every SP rank back-propagates the same ``aux``, so the all-reduce's backward
(:func:`seqpar.comm.gather.all_reduce_sum`) sums the ranks' equal gradients: rank r's router
probabilities get ``sp x`` their true gradient, which the average over the sp ranks (DDP / FSDP2 /
:func:`seqpar.sync_gradients`) divides out -- the seqpar loss convention (:mod:`seqpar.batch.loss`).
Over dp the aux term is each dp rank's own batch's (what the model computes without seqpar there),
weighted like the token loss: with ``num_items_in_batch`` (the token loss is this dp rank's share
of a sum over dp) its gradient is scaled by dp too, so the dp average sums the dp ranks' terms, as
transformers' Trainer does (``loss * num_processes``); without it the dp ranks' terms are averaged.

The sums are in float32 or the logits' or model's dtype if wider (transformers casts them to float32):
a float64 model's aux loss is float64-exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.gather import all_reduce_sum
from .loss import scale_grad


@dataclass(frozen=True)
class RouterSums:
    """One rank's share of the batch statistics (or the whole batch's, after :func:`reduce_sums`):
    ``probs [E]`` summed router probabilities (differentiable), ``counts [E]`` top-k assignments,
    ``rows`` kept (token, layer) pairs; ``count_norm``: the rule's ``c``."""

    probs: Tensor
    counts: Tensor
    rows: Tensor
    count_norm: int


def _compute_dtype(t: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """float32, or the logits' or the model's dtype if wider: a float64 model whose router emits
    float32 logits (JetMoE, GraniteMoE) still sums in float64."""
    return torch.promote_types(torch.promote_types(t.dtype, torch.float32), dtype or torch.float32)


def _kept(keep: Tensor | None, n: int, like: Tensor) -> Tensor:
    """``[n]`` 1.0 / 0.0 per flattened token (``keep [B, S_local]`` bool, None: every token)."""
    if keep is None:
        return like.new_ones(n)
    flat = keep.reshape(-1).to(device=like.device, dtype=like.dtype)
    if flat.numel() != n:
        raise ValueError(f"the router logits hold {n} tokens but the batch's shard {flat.numel()}: "
                         "feed the model model(**seqpar.shard_batch(batch, mesh))")
    return flat


def switch_sums(gate_logits: Sequence[Tensor], top_k: int, keep: Tensor | None,
                dtype: torch.dtype | None = None) -> RouterSums:
    """The sums of transformers' ``load_balancing_loss_func`` (Mixtral, Qwen-MoE, OLMoE, GPT-OSS,
    Jamba, ... : softmax over every expert, top-k of it): ``gate_logits`` one ``[B*S_local, E]``
    per router layer; ``keep [B, S_local]`` (False at padding) or None; ``dtype``: the model's."""
    cdtype = _compute_dtype(gate_logits[0], dtype)
    e = gate_logits[0].shape[-1]
    probs = counts = None
    rows = torch.zeros((), dtype=cdtype, device=gate_logits[0].device)
    for logits in gate_logits:  # [T, E]
        # top-k of the softmax in the logits' dtype, as transformers picks it; the sums in cdtype
        _, chosen = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)  # [T, k]
        kept = _kept(keep, logits.shape[0], rows)  # [T]
        c = torch.zeros(e, dtype=cdtype, device=rows.device).scatter_add_(
            0, chosen.reshape(-1), kept.repeat_interleave(top_k))
        p = (torch.softmax(logits.to(cdtype), dim=-1) * kept.unsqueeze(-1)).sum(0)  # [E]
        probs, counts, rows = (p, c, rows + kept.sum()) if probs is None else (probs + p, counts + c, rows + kept.sum())
    return RouterSums(probs, counts, rows, 1)


def product_key_sums(gate_logits: Sequence[Tensor], top_k: int, keep: Tensor | None,
                     dtype: torch.dtype | None = None) -> RouterSums:
    """The sums of Doge's ``load_balancing_loss_func`` (product-key routing, DogeCDMoE):
    ``gate_logits`` one ``[2, B*S_local, K]`` per router layer (E = K * K experts): an expert's
    score is the sum of its two keys' logits, the probabilities a softmax over the K * K scores."""
    cdtype = _compute_dtype(gate_logits[0], dtype)
    probs = counts = None
    rows = torch.zeros((), dtype=cdtype, device=gate_logits[0].device)
    for logits in gate_logits:  # [2, T, K]
        k = logits.shape[-1]
        (sx, sy), (ix, iy) = logits.topk(k, dim=-1)  # every key, sorted: [T, K] each
        scores = (sx.unsqueeze(-1) + sy.unsqueeze(-2)).flatten(-2)  # [T, K*K]
        index = (ix.unsqueeze(-1) * k + iy.unsqueeze(-2)).flatten(-2)  # [T, K*K] expert of each score
        _, pos = scores.topk(top_k, dim=-1)
        chosen = index.gather(-1, pos)  # [T, k]
        probs_kk = torch.softmax(scores.to(cdtype), dim=-1)
        weights = torch.zeros_like(probs_kk).scatter(-1, index, probs_kk)  # [T, E]
        kept = _kept(keep, weights.shape[0], rows)
        c = torch.zeros(k * k, dtype=cdtype, device=rows.device).scatter_add_(
            0, chosen.reshape(-1), kept.repeat_interleave(top_k))
        p = (weights * kept.unsqueeze(-1)).sum(0)
        probs, counts, rows = (p, c, rows + kept.sum()) if probs is None else (probs + p, counts + c, rows + kept.sum())
    return RouterSums(probs, counts, rows, top_k)


ROUTER_RULES: dict[str, Callable[..., RouterSums]] = {
    "switch": switch_sums,
    "product_key": product_key_sums,
}
"""How a family's aux loss reads its router logits (the families: :mod:`seqpar.integrations.hf.router_losses`)."""


def aux_from_sums(sums: RouterSums) -> Tensor:
    """``E * sum_e f_e * p_e`` from (whole-batch) sums; 0 when no token is kept."""
    rows = sums.rows.clamp(min=1.0)  # a batch of padding only: counts and probs are 0, so is the loss
    return (sums.counts / (rows * sums.count_norm) * (sums.probs / rows)).sum() * sums.probs.shape[0]


def reduce_sums(sums: RouterSums, group: dist.ProcessGroup | None, grad_scale: float = 1.0,
                flags: float = 0.0) -> tuple[RouterSums, Tensor]:
    """The whole SP group's sums from every rank's (one all-reduce; its backward is the sum of the
    ranks' gradients, see the module doc), and the sum of the ranks' ``flags`` (a 0-d tensor: a
    check every rank must agree on rides the same all-reduce). ``grad_scale``: an extra factor on
    the gradient of this rank's probabilities (dp, for a token loss that is a share of a sum over dp)."""
    e = sums.probs.shape[0]
    extra = torch.stack([sums.rows.to(sums.probs.dtype), sums.probs.new_tensor(flags)])
    flat = torch.cat([sums.probs, sums.counts.to(sums.probs.dtype), extra])  # [E | E | rows, flags]
    if grad_scale != 1.0:
        flat = scale_grad(flat, grad_scale)
    if group is not None and dist.get_world_size(group) > 1:
        flat = all_reduce_sum(flat, group=group)
    return RouterSums(flat[:e], flat[e:2 * e].detach(), flat[2 * e].detach(), sums.count_norm), flat[-1].detach()


def close(a: Tensor, b: Tensor, rtol: float = 1e-4) -> bool:
    """Whether two aux losses agree to well within float32 rounding (transformers sums in float32):
    the check that a family's own aux loss is the rule seqpar recomputes."""
    a, b = float(a.detach()), float(b.detach())
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-6)
