"""What attention computes, independent of how it is split, and the contract of a local kernel.

Which keys a query may see is described by an :class:`AttnSpec` (causal, window, chunk, softcap,
scale, sinks) and a :class:`MaskInfo` (global token positions, key padding, packed-document segment
ids, bidirectional span ids), so the same kernel serves a whole sequence (Ulysses) and one block of
a ring whose tokens are permuted (zigzag). Kernels work in the torch layout ``q, k [B, H(_kv), S, D]``,
``v [B, H_kv, Sk, Dv]`` (``H % H_kv == 0``, KV heads not repeated; ``Dv`` may differ from ``D``, as
in MLA). There are two kinds:

* :class:`LseKernel` -- ``forward(q, k, v, spec, mask) -> (out [B, H, Sq, Dv], lse [B, H, Sq])``
  with lse in :func:`acc_dtype` (``-inf`` and ``out = 0`` on rows that see no key), and
  ``backward(dout, q, k, v, out, lse, spec, mask) -> (dq, dk, dv)`` where ``out`` and ``lse`` may
  be those of the *whole* attention (ring attention passes the merged ones), which is what makes a
  blockwise backward exact. Ring and hybrid attention need one.
* :class:`LocalKernel` -- ``kernel(q, k, v, *, spec, mask) -> out``, differentiable by itself: any
  local attention (Ulysses wraps it).

Both say in ``supports`` which options of :class:`AttnSpec` they honour (None: trusted to read the
spec itself); asked for another, :func:`check_supported` raises instead of ignoring it. Attention
sinks need no support from an lse kernel: the code around it folds them into ``(out, lse)``
(:func:`seqpar.attention.blocks.fold_sinks`), so every lse kernel honours them and a plain local
kernel with a ``supports`` set (sdpa) cannot.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..errors import Refused


@dataclass(frozen=True)
class AttnSpec:
    """What attention computes, independent of how it is split.

    ``window``: a key at position k is visible from a query at q only if ``q - k < window``
    (with ``causal``), or ``|q - k| < window`` (without), as transformers' ``sliding_window``.
    ``chunk``: a query at q sees a key at k only if ``q // chunk == k // chunk`` (Llama 4's
    ``attention_chunk_size``); combines with causal, window and the masks.
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` after scaling (Gemma 2).
    ``sinks``: ``[H]`` one learnable logit per query head whose value vector is zero (GPT-OSS):
    ``out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sinks[h]))``. Under Ulysses the spec a
    local kernel sees carries this rank's heads only. Not compared: a spec is an option set.
    """

    causal: bool = False
    scale: float | None = None
    window: int | None = None
    softcap: float | None = None
    dropout: float = 0.0
    chunk: int | None = None
    sinks: Tensor | None = field(default=None, compare=False, hash=False)

    def scale_for(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)

    def options(self) -> set[str]:
        used = set()
        if self.window is not None:
            used.add("window")
        if self.softcap is not None:
            used.add("softcap")
        if self.dropout:
            used.add("dropout")
        if self.chunk is not None:
            used.add("chunk")
        if self.sinks is not None:
            used.add("sinks")
        return used


@dataclass(frozen=True)
class MaskInfo:
    """Which keys of a block each query may see, in global token coordinates.

    q_pos [Sq], k_pos [Sk]  long: index of each token in the unsharded sequence (None: 0..S-1);
                                  causal and window compare these, so permuted layouts stay exact.
    key_keep [B, Sk]        bool: False marks a padding key.
    q_seg [B, Sq], k_seg [B, Sk]  long: document id of each token in a packed row; a query sees
                                  only keys of its own document.
    q_blk [B, Sq], k_blk [B, Sk]  long: bidirectional span (block) id of each token, -1 for none
                                  (an image of Gemma 3, PaliGemma's prefix): a query and a key of
                                  the same span (id >= 0) see each other whatever their order --
                                  OR-ed with causal only, as transformers' ``blockwise_overlay``:
                                  padding, documents, window and chunk still hide (see
                                  :func:`dense_mask`). Spans need not be contiguous.
    plans                         where kernels keep what they plan from these tensors (document
                                  rectangles, flags, block masks): the part of the batch's
                                  :class:`~seqpar.attention.shard.BatchState` this block is, so the
                                  batch's layers plan once. None: planned per call.
    """

    q_pos: Tensor | None = None
    k_pos: Tensor | None = None
    key_keep: Tensor | None = None
    q_seg: Tensor | None = None
    k_seg: Tensor | None = None
    plans: dict | None = field(default=None, compare=False, repr=False)
    q_blk: Tensor | None = None
    k_blk: Tensor | None = None

    def tensors(self) -> tuple[Tensor | None, ...]:
        return self.q_pos, self.k_pos, self.key_keep, self.q_seg, self.k_seg, self.q_blk, self.k_blk

    @property
    def spans(self) -> bool:
        """Whether bidirectional span ids are given (both sides, or :func:`dense_mask` raises)."""
        return self.q_blk is not None or self.k_blk is not None

    def in_token_order(self, inverse: Tensor, plans: dict | None = None) -> MaskInfo:
        """This mask of a permuted self-attention block (``q_pos is k_pos``, a layout permutation)
        with its tokens taken back to token order by ``inverse`` ``[S]`` (the permutation's
        inverse): positions become the identity."""
        def order(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.index_select(1, inverse.to(t.device))

        seg, blk = order(self.q_seg), order(self.q_blk)
        return MaskInfo(key_keep=order(self.key_keep), q_seg=seg, k_seg=seg, plans=plans, q_blk=blk, k_blk=blk)

    def is_trivial(self) -> bool:
        return self.key_keep is None and self.q_seg is None and self.k_seg is None and not self.spans

    def positions(self, sq: int, sk: int, device: torch.device) -> tuple[Tensor, Tensor]:
        q_pos = self.q_pos if self.q_pos is not None else torch.arange(sq, device=device)
        k_pos = self.k_pos if self.k_pos is not None else torch.arange(sk, device=device)
        return q_pos, k_pos


def same_span(q_blk: Tensor, k_blk: Tensor) -> Tensor:
    """``[..., Sq, Sk]`` bool: query and key in the same bidirectional span (id >= 0), from
    ``q_blk [..., Sq]``, ``k_blk [..., Sk]``."""
    return (q_blk[..., :, None] == k_blk[..., None, :]) & (q_blk[..., :, None] >= 0)


def position_mask(spec: AttnSpec, q_pos: Tensor, k_pos: Tensor, blk: tuple[Tensor, Tensor] | None = None
                  ) -> Tensor | None:
    """The causal / window / chunk part of the mask, ``[Sq, Sk]`` bool (True = visible), or None.
    ``blk``: span ids ``(q_blk [..., Sq], k_blk [..., Sk])``: the causal part becomes ``causal OR
    same span`` (``[..., Sq, Sk]``), window and chunk stay AND-ed (Gemma 3's sliding layers)."""
    if not spec.causal and spec.window is None and spec.chunk is None:
        return None
    diff = q_pos[:, None] - k_pos[None, :]  # [Sq, Sk]
    allowed = torch.ones_like(diff, dtype=torch.bool)
    if spec.causal:
        allowed = allowed & ((diff >= 0) if blk is None else (diff >= 0) | same_span(*blk))
    if spec.window is not None:
        allowed &= (diff < spec.window) if spec.causal else (diff.abs() < spec.window)
    if spec.chunk is not None:
        allowed &= (q_pos // spec.chunk)[:, None] == (k_pos // spec.chunk)[None, :]
    return allowed


def dense_mask(spec: AttnSpec, mask: MaskInfo | None, sq: int, sk: int, device: torch.device) -> Tensor | None:
    """Everything that hides keys, as one bool ``[B or 1, 1, Sq, Sk]`` (True = visible), or None."""
    mask = mask or MaskInfo()
    q_pos, k_pos = mask.positions(sq, sk, device)
    blk = None
    if mask.spans:
        if mask.q_blk is None or mask.k_blk is None:
            raise ValueError("bidirectional spans need span ids for both queries and keys")
        blk = (mask.q_blk, mask.k_blk)
    out = position_mask(spec, q_pos, k_pos, blk)  # [Sq, Sk] or [B, Sq, Sk]
    out = None if out is None else (out[None, None] if out.dim() == 2 else out[:, None])
    if mask.key_keep is not None:
        keep = mask.key_keep[:, None, None, :]  # [B, 1, 1, Sk]
        out = keep if out is None else out & keep
    if mask.q_seg is not None or mask.k_seg is not None:
        if mask.q_seg is None or mask.k_seg is None:
            raise ValueError("packed sequences need segment ids for both queries and keys")
        same = mask.q_seg[:, None, :, None] == mask.k_seg[:, None, None, :]  # [B, 1, Sq, Sk]
        out = same if out is None else out & same
    return out


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype lse and merged partial outputs are kept in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class LseKernel(ABC):
    """A local kernel that returns the log-sum-exp and has an explicit backward (see the module doc)."""

    name: str
    supports: frozenset[str] | None

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None
                ) -> tuple[Tensor, Tensor]: ...

    @abstractmethod
    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 spec: AttnSpec, mask: MaskInfo | None) -> tuple[Tensor, Tensor, Tensor]: ...

    def fused_forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, causal: bool) -> tuple[Tensor, Tensor]:
        """:meth:`forward` of a block every query of which sees every key (``causal=False``) or
        that is the aligned causal diagonal (``causal=True``): no mask, nothing to plan. The ring's
        fast path (:attr:`~seqpar.attention.blocks.BlockPlan.fused`); a fused kernel overrides it
        with one call of its op. ``spec``'s window and chunk hide nothing of such a block."""
        return self.forward(q, k, v, replace(spec, causal=causal, window=None, chunk=None), None)

    def fused_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       spec: AttnSpec, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`backward` of a :meth:`fused_forward` block (the whole row's ``out`` and ``lse``)."""
        return self.backward(dout, q, k, v, out, lse, replace(spec, causal=causal, window=None, chunk=None), None)


class LocalKernel(ABC):
    """A differentiable local attention ``kernel(q, k, v, *, spec, mask) -> out [B, H, Sq, Dv]``."""

    name: str
    supports: frozenset[str] | None

    @abstractmethod
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, spec: AttnSpec, mask: MaskInfo | None) -> Tensor: ...

    def lse_twin(self, spec: AttnSpec) -> str | None:
        """A registered lse kernel that computes exactly what this kernel computes for ``spec``
        (``"auto"``: the device's varlen one), which ``torch.compile``-d calls run in its place,
        inside an op; None (the default): none does, such a call runs eagerly there."""
        return None


Kernel = LseKernel | LocalKernel


def check_supported(kernel: Kernel, spec: AttnSpec) -> None:
    """Raise ValueError if ``spec`` asks for an option ``kernel`` cannot honour."""
    if kernel.supports is None:
        return  # a plain function receives the spec and is trusted to read it
    missing = spec.options() - set(kernel.supports)
    if isinstance(kernel, LseKernel):
        missing.discard("sinks")  # folded into (out, lse) around the kernel
    if missing:
        raise Refused(
            f"attention kernel {kernel.name!r} cannot honour {sorted(missing)}; use kernel='auto' (picks one that"
            f" does{': dropout only sdpa samples' if 'dropout' in missing else ''}) or drop the option"
        )
