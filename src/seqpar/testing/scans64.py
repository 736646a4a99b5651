"""The recurrent mixers' scans in float64, token by token: the oracle for state passing.

transformers' torch scans compute in float32 whatever the model's dtype (``torch_chunk_gated_delta_rule``
and ``chunk_kimi_delta_attention`` cast to float32, ``mamba2_chunk_scan`` and
``mamba_selective_scan`` call ``.float()``), so a float64 model with them is float32-exact at best,
and a wrong initial state would hide under a float32 tolerance. These are the same recurrences in
their plain sequential form (what the chunked kernels compute, reassociated), in float64, with the
same signatures. :func:`float64_scans` puts them in place of a model's scans (through
:func:`seqpar.compat.kernels_replaced`) for the reference and the sequence-
parallel run alike, so the two must agree to float64 rounding::

    gated_delta_rule  S <- exp(g) S;  S <- S + k (b (v - S^T k))^T;  o = S^T q     (q, k l2-normed, q / sqrt(K))
    kimi_delta_rule   the same with exp(g) per key channel (rows of S)
    mamba2_scan       h <- exp(dt A) h + dt x B^T;  y = h C + D x                  (dt: + bias, softplus, clamp)
    selective_scan    h <- exp(dt A) * h + dt B x;  y = (h C + D x) * silu(z)       (dt: + bias, softplus)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..compat import kernels_replaced, modeling_module
from ..integrations.mixers import family_of, token_mixers

F64 = torch.float64


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
                output_final_state: bool, use_qk_l2norm_in_kernel: bool) -> tuple[Tensor, Tensor | None]:
    """``query, key [B, T, Hk, K]``, ``value [B, T, H, V]``, ``g [B, T, H]`` or ``[B, T, H, K]``, ``beta [B, T, H]``."""
    dtype, (b, t, h, dv) = query.dtype, value.shape
    rep = h // key.shape[2]
    q, k = (x.repeat_interleave(rep, dim=2).to(F64) for x in (query, key))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    v, g, beta = value.to(F64), g.to(F64), beta.to(F64)
    s = q.new_zeros(b, h, k.shape[-1], dv) if initial_state is None else initial_state.to(F64)  # [B, H, K, V]
    out = []
    for i in range(t):
        decay = g[:, i].exp()
        s = s * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        delta = (v[:, i] - (s * k[:, i, :, :, None]).sum(-2)) * beta[:, i, :, None]  # [B, H, V]
        s = s + k[:, i, :, :, None] * delta[:, :, None, :]
        out.append((s * q[:, i, :, :, None]).sum(-2))
    return torch.stack(out, 1).to(dtype), s if output_final_state else None


def gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64,
                     initial_state: Tensor | None = None, output_final_state: bool = False,
                     use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """``torch_chunk_gated_delta_rule`` in float64 (same arguments)."""
    return _delta_rule(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel)


def kimi_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64,
                    initial_state: Tensor | None = None, output_final_state: bool = False,
                    use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """``chunk_kimi_delta_attention`` in float64 (same arguments; ``g`` per key channel)."""
    return _delta_rule(query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel)


def mamba2_scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,  # noqa: N803
                D: Tensor | None = None, dt_bias: Tensor | None = None, initial_states: Tensor | None = None,  # noqa: N803
                dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
                return_final_states: bool = False, **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """``mamba2_chunk_scan`` in float64: ``hidden_states [B, T, H, P]``, ``dt [B, T, H]``,
    ``B, C [B, T, G, N]``, state ``[B, H, P, N]``."""
    b, t, h, p = hidden_states.shape
    dt = dt.to(F64) + (0 if dt_bias is None else dt_bias.to(F64))
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(dt_limit[0], dt_limit[1])
    x, a = hidden_states.to(F64), A.to(F64)
    bm, cm = (m.to(F64).repeat_interleave(h // m.shape[2], dim=2) for m in (B, C))  # [B, T, H, N]
    s = x.new_zeros(b, h, p, bm.shape[-1]) if initial_states is None else initial_states.to(F64)
    out = []
    for i in range(t):
        s = (dt[:, i] * a).exp()[..., None, None] * s + (dt[:, i, :, None] * x[:, i])[..., None] * bm[:, i, :, None, :]
        out.append((s * cm[:, i, :, None, :]).sum(-1))
    y = torch.stack(out, 1)
    if D is not None:
        y = y + D.to(F64)[:, None] * x
    return (y, s) if return_final_states else y


def selective_scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,  # noqa: N803
                   D: Tensor | None = None, z: Tensor | None = None, delta_bias: Tensor | None = None,  # noqa: N803
                   delta_softplus: bool = False, return_last_state: bool = False,
                   **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """``mamba_selective_scan`` in float64: ``hidden_states, dt, z [B, I, T]``, ``B, C [B, N, T]``,
    ``A [I, N]``, state ``[B, I, N]``."""
    x, dt, a = hidden_states.to(F64), dt.to(F64), A.to(F64)
    if delta_bias is not None:
        dt = dt + delta_bias.to(F64)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    s = x.new_zeros(x.shape[0], x.shape[1], a.shape[-1])
    out = []
    for i in range(x.shape[-1]):
        s = (a * dt[:, :, i, None]).exp() * s + (dt[:, :, i] * x[:, :, i])[..., None] * B.to(F64)[:, None, :, i]
        out.append((s * C.to(F64)[:, None, :, i]).sum(-1))
    y = torch.stack(out, -1)
    if D is not None:
        y = y + D.to(F64)[:, None] * x
    if z is not None:
        y = y * F.silu(z.to(F64))
    return (y, s) if return_last_state else y


SCANS64 = {"torch_chunk_gated_delta_rule": gated_delta_rule, "chunk_kimi_delta_attention": kimi_delta_rule,
           "mamba2_chunk_scan": mamba2_scan, "mamba_selective_scan": selective_scan}
"""Each scan seqpar's families declare (``StateKernels.scan``) -> its float64 oracle."""


@contextlib.contextmanager
def float64_scans(model: nn.Module) -> Iterator[None]:
    """Inside the block, the scans of ``model``'s handled token mixers are the float64 ones above
    (in their modeling modules: every model of those classes sees them)."""
    swaps: dict[Any, dict[str, Any]] = {}
    for _, mixer in token_mixers(model):
        kernels = family_of(mixer).state
        if kernels is not None:
            swaps.setdefault(modeling_module(type(mixer)), {})[kernels.scan] = SCANS64[kernels.scan]
    with contextlib.ExitStack() as stack:
        for module, replacements in swaps.items():
            stack.enter_context(kernels_replaced(module, replacements))
        yield
