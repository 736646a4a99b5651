"""Eager attention in float64 for exact parity checks (transformers' own eager softmax is float32)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EAGER_FLOAT64 = "eager_float64"


def eager_float64_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            softcap: float | None = None, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """Eager attention in the inputs' dtype. transformers' eager softmax runs in float32: in a
    float64 model that is float32-exact only, and its float64 mask minimum becomes -inf there, so
    a row a sliding window hides completely turns NaN. Same math otherwise (scale, softcap,
    additive mask, GQA). query ``[B, H, S, D]``, key / value ``[B, H_kv, S, D]`` -> ``[B, S, H, D]``."""
    n_rep = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(query, k.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask[..., : k.shape[2]]
    weights = torch.softmax(scores, dim=-1)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights


def register_eager_float64() -> str:
    """Register :func:`eager_float64_attention` (with transformers' eager mask) as "eager_float64"."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(EAGER_FLOAT64, eager_float64_attention)
    AttentionMaskInterface.register(EAGER_FLOAT64, eager_mask)
    return EAGER_FLOAT64
