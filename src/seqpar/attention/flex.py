"""``flex``: FlexAttention (``torch.nn.attention.flex_attention``) as an lse kernel -- one fused,
block-sparse call per block on CUDA (compiled), softcap included, for ring, hybrid and Ulysses.

The mask reaches flex twice, both from the :class:`~seqpar.attention.spec.MaskInfo` the batch
already carries, never as an ``S x S`` tensor:

* a ``BlockMask`` (:func:`flex_blocks`): each ``block x block`` tile of the scores is *empty*
  (skipped), *full* (every pair visible: no mask evaluated) or *partial*, classified from each
  tile's range of positions, document ids and padding -- ``O((S / block)^2)`` booleans, planned
  once per batch. A tile is called empty or full only when the ranges prove it, so the
  classification is conservative: a doubtful tile is partial, and partial tiles are exact;
* a ``mask_mod`` (:func:`mask_mod`): the per-pair rule (causal OR same bidirectional span, window,
  chunk on global positions; same document; real key) that flex evaluates on partial tiles only.
  A tile where spans may add pairs is partial (both sides hold span tokens).

Softcap is a ``score_mod``; GQA is flex's own (``enable_gqa``). The forward returns flex's lse.
Flex has no backward that takes a given (merged) ``out`` and ``lse``, so the backward recomputes
the block's forward with autograd and pulls the merged gradient through its ``out`` and ``lse``
(:func:`~seqpar.attention.blocks.merged_block_grads`): exact, at one more forward per block.

On CUDA the call is ``torch.compile``-d (uncompiled flex materialises the scores: O(S^2)); on other
devices it runs uncompiled, forward only (torch has no CPU backward for flex) -- for tests.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from .. import compat
from ..errors import Refused
from .blocks import merged_block_grads
from .spec import AttnSpec, LseKernel, MaskInfo, acc_dtype, check_supported
from .varlen import per_batch

BLOCK = 128
"""flex's tile edge (its default ``BLOCK_SIZE``)."""

_warned: set[str] = set()  # said once per process: {"uncompiled"} at most (see kernels._warned)

_BIG = 1 << 62


def _ranges(x: Tensor, n: int, block: int) -> tuple[Tensor, Tensor]:
    """Per-tile ``(min, max)`` of ``x [..., n]`` over runs of ``block`` along the last dim:
    ``[..., ceil(n / block)]`` each; the last tile's missing tail counts as nothing."""
    nb = -(-n // block)
    tail = nb * block - n
    lo = torch.cat([x, x.new_full((*x.shape[:-1], tail), _BIG)], dim=-1) if tail else x
    hi = torch.cat([x, x.new_full((*x.shape[:-1], tail), -_BIG)], dim=-1) if tail else x
    return (lo.view(*x.shape[:-1], nb, block).amin(dim=-1), hi.view(*x.shape[:-1], nb, block).amax(dim=-1))


def _allowed_distances(spec: AttnSpec) -> tuple[int, int] | None:
    """The ``q - k`` distances causal and window allow, as ``[lo, hi]``; None when all are."""
    if spec.causal:
        return 0, (spec.window - 1 if spec.window is not None else _BIG)
    if spec.window is not None:
        return -(spec.window - 1), spec.window - 1
    return None


def flex_blocks(spec: AttnSpec, mask: MaskInfo | None, sq: int, sk: int, batch: int, block: int = BLOCK,
                device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """``(partial, full)``: bool ``[B or 1, ceil(sq / block), ceil(sk / block)]`` -- the tiles of a
    ``(queries x keys)`` block that flex must compute with the mask, and those it may compute
    without (every pair visible). A tile in neither is empty: nothing in it is visible. Only
    provable facts of each tile's ranges are used (see the module doc)."""
    mask = mask or MaskInfo()
    device = device if device is not None else next(
        (t.device for t in mask.tensors() if t is not None),
        torch.device("cpu"))
    q_pos, k_pos = (p.to(device, torch.long) for p in mask.positions(sq, sk, device))
    (qlo, qhi), (klo, khi) = _ranges(q_pos, sq, block), _ranges(k_pos, sk, block)  # [nq], [nk]
    some = torch.ones(qlo.numel(), klo.numel(), dtype=torch.bool, device=device)  # [nq, nk]
    every = some.clone()
    span = _allowed_distances(spec)
    if span is not None:
        dlo, dhi = qlo[:, None] - khi[None], qhi[:, None] - klo[None]  # the tile's q - k lie in [dlo, dhi]
        some &= (dhi >= span[0]) & (dlo <= span[1])
        every &= (dlo >= span[0]) & (dhi <= span[1])
    if spec.chunk is not None:
        qc, kc = (qlo // spec.chunk, qhi // spec.chunk), (klo // spec.chunk, khi // spec.chunk)
        some &= (qc[0][:, None] <= kc[1][None]) & (kc[0][None] <= qc[1][:, None])
        every &= ((qc[0] == qc[1])[:, None] & (kc[0] == kc[1])[None] & (qc[0][:, None] == kc[0][None]))
    some, every = some[None], every[None]  # [1, nq, nk]
    if mask.q_seg is not None or mask.k_seg is not None:
        if mask.q_seg is None or mask.k_seg is None:
            raise ValueError("packed sequences need segment ids for both queries and keys")
        (slo, shi), (tlo, thi) = (_ranges(seg.to(device, torch.long), n, block)
                                  for seg, n in ((mask.q_seg, sq), (mask.k_seg, sk)))
        some = some & (slo[:, :, None] <= thi[:, None]) & (tlo[:, None] <= shi[:, :, None])
        every = every & ((slo == shi)[:, :, None] & (tlo == thi)[:, None] & (slo[:, :, None] == tlo[:, None]))
    if mask.key_keep is not None:
        keep = mask.key_keep.to(device).long()
        kept_lo, kept_hi = _ranges(keep, sk, block)  # tail: min ignores it (big), max ignores it (-big)
        some = some & (kept_hi == 1)[:, None]
        every = every & (kept_lo == 1)[:, None]
    if spec.causal and mask.spans:  # a span adds pairs causal hides: a tile both sides of which hold span tokens
        (_, qb), (_, kb) = (_ranges(blk.to(device, torch.long), n, block) for blk, n in ((mask.q_blk, sq),
                                                                                          (mask.k_blk, sk)))
        some = some | ((qb >= 0)[:, :, None] & (kb >= 0)[:, None])  # [B, nq, nk]; partial tiles are exact
    return some & ~every, every


def _tail(t: Tensor) -> Tensor:
    """``t [..., n] -> [..., n + BLOCK]``, zeros (False) appended."""
    return torch.cat([t, t.new_zeros((*t.shape[:-1], BLOCK))], dim=-1)


def mask_mod(spec: AttnSpec, mask: MaskInfo | None, sq: int, sk: int, batch: int, device: torch.device
             ) -> Callable | None:
    """flex's per-pair rule for ``spec`` and ``mask`` (None: every pair visible). One rule for every
    structure -- what a batch lacks is a neutral value (distances unbounded, one chunk, one
    document, no padding), every value a tensor -- so compiled flex makes one graph per dtype
    whatever the masks, options and lengths (dynamo's recompile limit is 8 per function)."""
    mask = mask or MaskInfo()
    span = _allowed_distances(spec)
    if span is None and spec.chunk is None and mask.q_seg is None and mask.key_keep is None:
        return None
    lo, hi = span if span is not None else (-_BIG, _BIG)
    spans = spec.causal and mask.spans  # spans widen causal (q - k >= 0) only
    # filled on the device (no host-to-device copy, which would synchronize)
    lo, hi, chunk = (torch.full((), x, dtype=torch.long, device=device) for x in (lo, hi, spec.chunk or _BIG))
    # a tile at the end of a length that is no multiple of BLOCK may ask for indices past it (flex
    # drops those pairs): the captured tensors carry BLOCK more entries, so no lookup is out of bounds
    q_pos, k_pos = (_tail(p.to(device, torch.long)) for p in mask.positions(sq, sk, device))

    def rows(t: Tensor | None, n: int, fill: int) -> Tensor:  # [B, n + BLOCK], contiguous: same guards always
        if t is None:
            return torch.full((batch, n + BLOCK), fill, device=device, dtype=torch.long)
        return _tail(t.to(device, torch.long)).expand(batch, -1).contiguous()

    q_seg, k_seg, keep = rows(mask.q_seg, sq, 0), rows(mask.k_seg, sk, 0), rows(mask.key_keep, sk, 1)
    q_blk, k_blk = rows(mask.q_blk if spans else None, sq, -1), rows(mask.k_blk if spans else None, sk, -1)

    def visible(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        qp, kp = q_pos[qi], k_pos[ki]
        qb = q_blk[b, qi]
        return (((qp - kp >= lo) | ((qb == k_blk[b, ki]) & (qb >= 0))) & (qp - kp <= hi)
                & (qp // chunk == kp // chunk) & (q_seg[b, qi] == k_seg[b, ki]) & (keep[b, ki] == 1))

    return visible


def _softcap(cap: float, device: torch.device) -> Callable:
    cap_t = torch.full((), cap, dtype=torch.float64, device=device)  # a tensor: another cap, no new graph

    def capped(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return cap_t * torch.tanh(score / cap_t)

    return capped


@functools.cache
def _flex(compiled: bool) -> Callable:
    """flex_attention, compiled or not. Compiled with dynamic shapes from the start, and with
    every structure behind one ``mask_mod`` of tensors (:func:`mask_mod`), a new batch -- new
    tensors in a new closure, another length, other documents -- reuses the graphs the first made
    (dynamo guards a closure's code, not its identity; checked on the CPU with its eager backend)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


def _block_mask(spec: AttnSpec, mask: MaskInfo | None, sq: int, sk: int, batch: int, device: torch.device):
    from torch.nn.attention.flex_attention import BlockMask

    info = mask or MaskInfo()
    # the tile lists are the batch's (kept while its tensors live); the mask_mod, which holds those
    # tensors, is made per call -- kept in the per-batch store it would keep them alive
    lists = per_batch(info, ("flex", spec.causal, spec.window, spec.chunk, sq, sk, batch, BLOCK, str(device)),
                      lambda: _tile_lists(*(t.expand(batch, -1, -1) for t in flex_blocks(spec, info, sq, sk, batch,
                                                                                         BLOCK, device))))
    return BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=BLOCK, mask_mod=mask_mod(spec, info, sq, sk, batch, device),
                                    seq_lengths=(sq, sk))


def _tile_lists(partial: Tensor, full: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """flex's ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)`` ``[B, 1, nq(, nk)]``:
    per query tile, how many key tiles of each kind and which (first), int32 -- one per row even
    where the rows are alike, so that compiled flex sees one batch shape."""
    def listed(kind: Tensor) -> tuple[Tensor, Tensor]:
        order = torch.argsort((~kind).to(torch.int8), dim=-1, stable=True)  # listed tiles first, in order
        return kind.sum(dim=-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    return (*listed(partial), *listed(full))


class FlexKernel(LseKernel):
    """FlexAttention with a BlockMask built from the batch's structure (see the module doc)."""

    name = "flex"
    supports = frozenset({"window", "softcap", "chunk"})

    def _call(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None
              ) -> tuple[Tensor, Tensor]:
        from torch.nn.attention import flex_attention as fa

        if q.device.type != "cuda" and any(x.requires_grad for x in (q, k, v)):  # as torch's check reads it
            raise Refused(f"kernel='flex' has no backward on {q.device.type}: torch runs FlexAttention's "
                          "backward on CUDA only; use kernel='auto' (flash_cpu on CPU)")
        sq, sk = q.shape[2], k.shape[2]
        bm = _block_mask(spec, mask, sq, sk, q.shape[0], q.device)
        aux = {"return_aux": fa.AuxRequest(lse=True)} if hasattr(fa, "AuxRequest") else {"return_lse": True}
        compiled = q.device.type == "cuda"
        if not compiled and "uncompiled" not in _warned:
            _warned.add("uncompiled")
            warnings.warn(f"kernel='flex' on {q.device.type} runs torch's uncompiled flex, which builds the S x S "
                          "scores (and has no backward): for tests; use kernel='auto'", stacklevel=2)
        # past dynamo's recompile limit a compiled call would silently run uncompiled (O(S^2)): raise instead
        with compat.fail_on_recompile_limit(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out, res = _flex(compiled)(
                q, k, v, score_mod=None if spec.softcap is None else _softcap(spec.softcap, q.device), block_mask=bm,
                scale=spec.scale_for(q.shape[-1]), enable_gqa=q.shape[1] != k.shape[1], **aux)
        return out, (res.lse if hasattr(res, "lse") else res).to(acc_dtype(q.dtype))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, spec: AttnSpec, mask: MaskInfo | None
                ) -> tuple[Tensor, Tensor]:
        check_supported(self, spec)
        with torch.no_grad():
            return self._call(q, k, v, spec, mask)

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: AttnSpec,
                 mask: MaskInfo | None) -> tuple[Tensor, Tensor, Tensor]:
        return merged_block_grads(lambda a, b, c: self._call(a, b, c, spec, mask), dout, q, k, v, out, lse)
