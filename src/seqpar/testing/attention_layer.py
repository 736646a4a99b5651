"""A residual attention layer over :func:`seqpar.sp_attention`, for tests that run whole steps of
layers without transformers (host-sync counts on CPU, CUDA sync checks on a GPU)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..attention.dispatch import sp_attention
from ..attention.kernels import KernelArg
from ..attention.shard import SeqShard


class AttentionLayer(nn.Module):
    """``x + o(attention(q(x), k(x), v(x)))``, causal, GQA (``kv_heads`` of ``heads``)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q = nn.Linear(hidden, heads * dim, dtype=dtype)
        self.kv = nn.Linear(hidden, 2 * kv_heads * dim, dtype=dtype)
        self.o = nn.Linear(heads * dim, hidden, dtype=dtype)

    def forward(self, x: Tensor, mesh: DeviceMesh, strategy: str, shard: SeqShard | None,
                kernel: KernelArg | None) -> Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim)  # [B, S/P, H, D]
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.dim).unbind(2)  # [B, S/P, H_kv, D]
        out = sp_attention(q, k, v, mesh=mesh, strategy=strategy, causal=True, kernel=kernel, shard=shard,
                           validate=False)  # [B, S/P, H, D]
        return x + self.o(out.reshape(b, s, -1))
