"""Float64 oracle of the MoE router aux loss, for the parity runs (model_parity, zoo) and unit tests.

transformers' ``load_balancing_loss_func`` sums in float32 (``.float()``) whatever the model's
dtype, so it is no float64 reference: :func:`switch_aux` writes the same loss from its definition
in float64 -- one-hot top-k assignments and softmax probabilities averaged over every kept
(token, layer) -- and is checked against transformers' own function to float32 precision
(tests/batch/test_router_loss.py). Doge's product-key function computes in the logits' dtype, so
for it transformers' own function is float64 already (:func:`product_key_aux`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .. import compat
from ..integrations.hf.router_losses import RULES, model_setting


def switch_aux(gate_logits: Sequence[Tensor], top_k: int, keep: Tensor | None) -> Tensor:
    """``E * sum_e f_e p_e`` over every layer's ``[T, E]`` logits and the tokens ``keep [T]`` marks (None: all)."""
    logits = torch.stack(list(gate_logits))  # [L, T, E]
    e = logits.shape[-1]
    chosen = torch.topk(torch.softmax(logits, -1), top_k, dim=-1).indices  # top-k as transformers picks it
    assigned = torch.nn.functional.one_hot(chosen, e).sum(-2).to(torch.float64)  # [L, T, E]
    probs = torch.softmax(logits.to(torch.float64), -1)  # [L, T, E]
    w = (torch.ones(logits.shape[1], dtype=torch.float64) if keep is None else keep.reshape(-1).to(torch.float64))
    n = w.sum() * logits.shape[0]
    f = (assigned * w[None, :, None]).sum((0, 1)) / n
    p = (probs * w[None, :, None]).sum((0, 1)) / n
    return (f * p).sum() * e


def product_key_aux(model: nn.Module, gate_logits: Sequence[Tensor], top_k: int, keep: Tensor | None) -> Tensor:
    """Doge's own function (float64 for float64 logits), on ``[2, T, K]`` logits per layer."""
    fn = compat.load_balancing_loss_func(type(model))
    k = gate_logits[0].shape[-1]
    mask = None if keep is None else keep.reshape(1, -1)
    return fn(tuple(gate_logits), k * k, k, top_k, mask)


def router_term(model: nn.Module, runs: list[tuple[tuple[Tensor, ...], Tensor | None]]) -> Tensor | float:
    """``coef * aux`` of the whole batch from the reference's forwards: ``runs`` holds each
    forward's ``(router_logits, attention_mask or None)`` (a packed batch runs document by document:
    its aux loss is over their union). 0 for a model without an aux loss."""
    if not runs:
        return 0.0
    top_k = int(model_setting(model, ("num_experts_per_tok",)))
    coef = float(model_setting(model, ("router_aux_loss_coef", "aux_loss_coef"), 0.0))
    rule = RULES.get(getattr(model.config, "model_type", ""), "switch")
    token_dim = 1 if rule == "product_key" else 0
    layers = [torch.cat([r[0][i] for r in runs], dim=token_dim) for i in range(len(runs[0][0]))]
    masks = [m.reshape(-1) if m is not None else torch.ones(r[0][0].shape[token_dim], dtype=torch.long)
             for r, m in ((r, r[1]) for r in runs)]
    keep = torch.cat(masks).bool()
    aux = product_key_aux(model, layers, top_k, keep) if rule == "product_key" else switch_aux(layers, top_k, keep)
    return coef * aux


def collect(outputs: Any, mask: Tensor | None, runs: list[tuple[tuple[Tensor, ...], Tensor | None]] | None) -> None:
    """Keep a reference forward's router logits in ``runs`` when the model computed an aux loss."""
    if runs is not None and getattr(outputs, "aux_loss", None) is not None and outputs.router_logits:
        runs.append((tuple(outputs.router_logits), mask))
