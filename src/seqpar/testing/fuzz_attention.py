"""The attention half of the seeded fuzz (:mod:`seqpar.testing.fuzz`): ``sp_attention`` on one rank's
shard of a drawn case against the float64 reference on the whole batch, forward and backward."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..attention.dispatch import sp_attention
from ..attention.layout import layout_indices
from ..attention.reference import reference_attention
from .fuzz_cases import FuzzCase, Outcome

ATTN_TOL = 1e-10  # float64 against float64: rounding only (as tests/attention)
F32_ULPS = 8  # float32: twice the unsharded float32 reference's error plus 8 ulp (tests/attention/test_lse_kernels)
# plus 2 ulp per rank: the sharded path merges P partial outputs (out, lse) and sums each K/V block's
# gradient over P partials, in float32 -- a rounding of the running value per rank the unsharded kernel
# does not have (measured: hybrid P=4, dk 3.0e-7 against 2.8e-7 for 8 ulp; seed 212)


def attention_masks(case: FuzzCase, g: torch.Generator) -> tuple[Tensor | None, Tensor | None]:
    """``(key_padding_mask [B, S] bool, segment_ids [B, S] long)`` of a case, global."""
    b, s = case.batch, case.seq
    keep = seg = None
    if case.mask in ("right", "left", "empty-row", "packed-pad"):
        keep = torch.ones(b, s, dtype=torch.bool)
        for row in range(b):
            n = int(torch.randint(0, s + 1, (1,), generator=g))  # padded tokens (0..S: a whole row too)
            if case.mask == "empty-row" and row == 0:
                n = s
            if case.mask == "left" or (case.mask != "right" and row % 2):
                keep[row, :n] = False
            else:
                keep[row, s - n:] = False
    if case.mask in ("packed", "packed-pad"):
        seg = (torch.rand(b, s, generator=g) < 0.25).long().cumsum(-1)  # a new document at ~1 token in 4
    return keep, seg


def _err(a: Tensor, b: Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def run_attention(case: FuzzCase, meshes: dict[str, DeviceMesh]) -> Outcome:
    """``sp_attention`` on this rank's shard against the float64 reference on the whole batch."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(case.seed)
    b, s, h, hk, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    q, k, v, grad = (torch.randn(b, s, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h))
    keep, seg = attention_masks(case, g)
    spec = dict(causal=case.causal, window=case.window)
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_in, **spec, key_padding_mask=keep, segment_ids=seg)
    ref_out.backward(grad)
    dt = getattr(torch, case.dtype)
    floor = [0.0] * 4
    if dt != torch.float64:  # the unsharded reference in that dtype: the precision the dtype allows
        low = [t.to(dt).requires_grad_(True) for t in (q, k, v)]
        low_out, _ = reference_attention(*low, **spec, key_padding_mask=keep, segment_ids=seg)
        low_out.backward(grad.to(dt))
        floor = [2 * _err(x, y) + (F32_ULPS + 2 * case.world) * torch.finfo(dt).eps * float(y.detach().abs().max())
                 for x, y in zip((low_out, *(t.grad for t in low)), (ref_out, *(t.grad for t in ref_in)), strict=True)]

    strategy, layout = case.strategy, case.layout
    odd = case.odd if rank == case.odd_rank else None
    if odd == "strategy":
        strategy = "ring" if strategy != "ring" else "ulysses"
    if odd == "layout":
        layout = "zigzag" if layout == "contiguous" else "contiguous"
    mesh = meshes["hybrid" if case.strategy == "hybrid" else "flat"]  # one mesh for all: the majority's
    ulysses = 2 if strategy == "hybrid" else 1
    idx = layout_indices(s, case.world, layout, ulysses)[rank]
    local = [t[:, idx].to(dt) for t in (q, k, v)]
    opts: dict = {**spec, "kernel": "reference", "key_padding_mask": None if keep is None else keep[:, idx],
                  "segment_ids": None if seg is None else seg[:, idx], "layout": layout}
    if odd == "dtype":
        local = [t.to(torch.float32 if dt == torch.float64 else torch.float64) for t in local]
    elif odd in ("heads", "head_dim", "batch", "seq-k"):
        shape = {"heads": (b, len(idx), h + hk, d), "head_dim": (b, len(idx), h, d + 2),
                 "batch": (b + 1, len(idx), h, d)}.get(odd)
        if shape is not None:
            local[0] = torch.randn(*shape, dtype=dt)
            if odd != "heads":
                local[1:] = [torch.randn(*shape[:2], hk, shape[3], dtype=dt) for _ in range(2)]
        else:  # k one token longer than q (a shard of another length: also where this rank holds none)
            local[1] = torch.cat([local[1], local[1].new_zeros(b, 1, hk, d)], dim=1)
    elif odd == "mask-given":
        opts["key_padding_mask"] = None if keep is not None else torch.ones(b, len(idx), dtype=torch.bool)
    elif odd == "mask-shape":
        opts["key_padding_mask"] = torch.ones(b, len(idx) + 1, dtype=torch.bool)
    elif odd == "causal":
        opts["causal"] = not case.causal
    elif odd == "window":
        opts["window"] = 2 if case.window is None else None
    local = [t.requires_grad_(True) for t in local]
    out = sp_attention(*local, mesh=mesh, strategy=strategy, **opts)
    out.backward(grad[:, idx].to(out.dtype) if out.shape == grad[:, idx].shape else torch.ones_like(out))
    if odd is not None:  # a disagreement that ran through: wrong by construction, whatever the numbers
        return Outcome("inexact", f"rank {rank} ran with odd {odd}")
    errs = [_err(x, y[:, idx]) for x, y in zip((out, *(t.grad for t in local)), (ref_out, *(t.grad for t in ref_in)),
                                                strict=True)]
    bounds = [ATTN_TOL if dt == torch.float64 else f for f in floor]
    bad = [f"{n} {e:.3g} > {t:.3g}" for n, e, t in zip(("out", "dq", "dk", "dv"), errs, bounds, strict=True) if e > t]
    return Outcome("inexact", "; ".join(bad)) if bad else Outcome("exact", f"max err {max(errs):.3g}")
