"""The model's own attention function as seqpar's local kernel under Ulysses (see
:mod:`~seqpar.integrations.hf.parallelize`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...attention.kernels import KERNELS, attend, lse_kernel_for
from ...attention.layout import inverse_permutation
from ...attention.spec import AttnSpec, LocalKernel, MaskInfo, dense_mask
from ...attention.varlen import mask_flag, per_batch, plan_mask


class _LocalHeads:
    """The attention module as the local kernel sees it after Ulysses: every attribute of the real
    module, except that its query heads share each KV head ``n_rep``-fold -- the ratio of this
    rank's head slice, which need not be the config's."""

    def __init__(self, module: nn.Module, n_rep: int, sinks: Tensor | None) -> None:
        self._module = module
        self.num_key_value_groups = n_rep
        if sinks is not None:  # this rank's slice of the heads' sink logits (GPT-OSS reads module.sinks)
            self.sinks = sinks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class ModelKernel(LocalKernel):
    """The model's own attention function as seqpar's local kernel (a plain callable kernel:
    ``fn(q, k, v, *, spec, mask) -> out``, layouts ``[B, H, S, D]``, differentiable by itself).

    The mask it gets is seqpar's (global positions, window, padding, documents), built once per
    batch and layer kind and shared by all layers (kept in the batch's plans, see
    :func:`seqpar.attention.varlen.per_batch`): a bool mask for ``sdpa``, an additive one (0 /
    dtype min, as transformers' eager mask) for ``eager``. Rows that see no key at all (padding
    queries) are computed against every key and zeroed, so no NaN can reach the backward.

    transformers' own ``sdpa`` function is plain SDPA: where it would need a mask (padded or packed
    rows, a window that cuts the sequence) and there is no dropout, the block runs on seqpar's
    varlen lse kernel instead (the same math, O(S) memory: no ``[B, 1, S, S]`` mask). Other
    functions (``eager`` computes every score itself) get the dense mask their format asks for.
    """

    supports = None  # the model's function reads softcap, dropout and the window mask itself

    def __init__(self, fn: Callable[..., tuple[Tensor, Any]], module: nn.Module, kind: str) -> None:
        assert kind in ("bool", "additive")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.fn, self.module, self.kind = fn, module, kind
        self.name = f"the model's own ({getattr(fn, '__name__', 'attention')})"
        self.plain_sdpa = fn is sdpa_attention_forward

    def lse_twin(self, spec: AttnSpec) -> str | None:
        # transformers' sdpa function is plain SDPA: without dropout, seqpar's varlen kernel is the same math
        return "auto" if self.plain_sdpa and not spec.dropout else None

    def _mask(self, spec: AttnSpec, mask: MaskInfo, q: Tensor) -> tuple[bool, Tensor | None, Tensor | None]:
        """(is_causal flag, mask in the function's format or None, rows that see a key or None)."""
        s = q.shape[2]

        def build() -> tuple[bool, Tensor | None, Tensor | None]:
            if self.kind == "bool":
                causal, allowed = plan_mask(spec, mask, s, s, q.device)
            else:  # eager applies nothing by itself: always give it the whole mask
                causal, allowed = False, dense_mask(spec, mask, s, s, q.device)
            seen = None
            if allowed is not None:
                seen = allowed.any(dim=-1, keepdim=True)  # [B or 1, 1, S, 1]
                allowed = allowed | ~seen
                if bool(seen.all()):
                    seen = None
                if self.kind == "additive":
                    allowed = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(
                        ~allowed, torch.finfo(q.dtype).min)
            return causal, allowed, seen

        return per_batch(mask, ("model mask", self.kind, spec.causal, spec.window, spec.chunk, q.dtype, q.device, s),
                         build)

    def _in_order(self, mask: MaskInfo) -> tuple[MaskInfo, Tensor | None, Tensor | None]:
        """A permuted layout (zigzag) put back in token order: ``(mask, perm, inverse)``. The
        model's function then sees the sequence exactly as without SP (same key order in its
        reductions, and sdpa keeps its is_causal fast path)."""
        if mask.q_pos is None or mask.k_pos is None or not (mask.q_pos is mask.k_pos or per_batch(
                mask, ("same positions",), lambda: torch.equal(mask.q_pos, mask.k_pos))):
            return mask, None, None

        def reorder() -> tuple[MaskInfo, Tensor, Tensor]:
            inv = inverse_permutation(mask.q_pos)
            return mask.in_token_order(inv, plans=None if mask.plans is None else {}), mask.q_pos, inv

        return per_batch(mask, ("in token order",), reorder)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, spec: AttnSpec, mask: MaskInfo | None) -> Tensor:
        # q [B, H, S, D], k / v [B, H_kv, S, D], the whole sequence in layout order
        mask, perm, inv = self._in_order(mask or MaskInfo())
        if inv is not None:
            q, k, v = (t.index_select(2, inv.to(t.device)) for t in (q, k, v))
        s = q.shape[2]
        if self.plain_sdpa and not spec.dropout and mask_flag(spec, mask, s, s, q.device) is None:
            out = attend(q, k, v, spec, mask, KERNELS[lse_kernel_for(q.device, q.dtype, spec)])
            return out if perm is None else out.index_select(2, perm.to(out.device))
        causal, attn_mask, seen = self._mask(spec, mask, q)
        extra: dict[str, Any] = {} if spec.softcap is None else {"softcap": spec.softcap}
        if spec.sinks is not None:
            extra["s_aux"] = spec.sinks
        out, _ = self.fn(_LocalHeads(self.module, q.shape[1] // k.shape[1], spec.sinks), q, k, v, attn_mask,
                         dropout=spec.dropout, scaling=spec.scale, is_causal=causal, **extra)
        out = out.transpose(1, 2)  # [B, S, H, D] -> [B, H, S, D]
        out = out if seen is None else out * seen
        return out if perm is None else out.index_select(2, perm.to(out.device))


def eager_function(module: nn.Module) -> Callable[..., Any] | None:
    """The ``eager_attention_forward`` of the module's modeling file (public, module level), if any."""
    return getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)


def original_function(original: str, module: nn.Module) -> tuple[Callable[..., Any] | None, str]:
    """The model's own attention function and the mask format it takes, or ``(None, "")``.

    The format is read from the mask function registered for the same name: transformers'
    ``sdpa_mask`` (bool) or ``eager_mask`` (additive). "eager" itself is the module's modeling-file
    function. Anything else (flash / flex masks, unknown) is not wrapped.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask, sdpa_mask

    mask_fn = AttentionMaskInterface().get(original)
    kind = "bool" if mask_fn is sdpa_mask else "additive" if mask_fn is eager_mask else ""
    fn = eager_function(module) if original == "eager" else AttentionInterface().get(original)
    return (fn, kind) if fn is not None and kind else (None, "")
