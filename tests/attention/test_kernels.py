"""Local kernels against the oracle, and the oracle against a naive per-query loop."""

import math

import pytest
import torch

from seqpar.attention.blocks import plan_block
from seqpar.attention.kernels import KERNELS, attend
from seqpar.attention.reference import math_attention, reference_attention
from seqpar.attention.spec import AttnSpec, MaskInfo


def naive(q, k, v, *, causal, scale, window, softcap, keep, seg, pos):
    """One query at a time, straight from the definition. q [B,S,H,D], k/v [B,S,Hk,D]."""
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            for i in range(s):
                logits, vals = [], []
                for j in range(s):
                    if keep is not None and not keep[bi, j]:
                        continue
                    if seg is not None and seg[bi, i] != seg[bi, j]:
                        continue
                    diff = int(pos[i] - pos[j])
                    if causal and diff < 0:
                        continue
                    if window is not None and (diff >= window if causal else abs(diff) >= window):
                        continue
                    x = float(q[bi, i, hi] @ k[bi, j, hi // rep]) * scale
                    if softcap is not None:
                        x = softcap * math.tanh(x / softcap)
                    logits.append(x)
                    vals.append(v[bi, j, hi // rep])
                if logits:
                    w = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                    out[bi, i, hi] = sum(wj * vj for wj, vj in zip(w, vals, strict=True))
    return out


def _inputs(seed=0, b=2, s=9, h=4, hk=2, d=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, 6:] = False
    keep[1, :3] = False  # left padding: with causal, rows 0-2 of batch 1 see nothing
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 2, 2, 3]])
    pos = torch.tensor([0, 8, 1, 7, 2, 6, 3, 5, 4])  # a permuted (zigzag-like) layout
    return q, k, v, keep, seg, pos


OPTIONS = [
    dict(causal=False, window=None, softcap=None, scale=None),
    dict(causal=True, window=None, softcap=None, scale=0.7),
    dict(causal=True, window=3, softcap=None, scale=None),
    dict(causal=False, window=2, softcap=1.5, scale=None),
    dict(causal=True, window=None, softcap=2.0, scale=0.4),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("masks", ["none", "keep", "seg", "keep+seg+pos"])
def test_reference_matches_naive_loop(opts, masks):
    q, k, v, keep, seg, pos = _inputs()
    keep = keep if "keep" in masks else None
    seg = seg if "seg" in masks else None
    positions = pos if "pos" in masks else None
    out, lse = reference_attention(q, k, v, key_padding_mask=keep, segment_ids=seg, positions=positions, **opts)
    scale = opts["scale"] or q.shape[-1] ** -0.5
    want = naive(q, k, v, causal=opts["causal"], scale=scale, window=opts["window"], softcap=opts["softcap"],
                 keep=keep, seg=seg, pos=positions if positions is not None else torch.arange(q.shape[1]))
    assert (out - want).abs().max() < 1e-12
    assert not torch.isnan(lse).any()


def _as_bhsd(*ts):
    return [t.transpose(1, 2).contiguous() for t in ts]


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("kernel", ["reference", "flash_cpu", "sdpa"])
def test_kernel_forward_backward_vs_autograd_reference(opts, kernel):
    q, k, v, keep, seg, pos = _inputs(seed=1)
    spec = AttnSpec(causal=opts["causal"], scale=opts["scale"], window=opts["window"], softcap=opts["softcap"])
    kern = KERNELS[kernel]
    if spec.options() - set(kern.supports):
        with pytest.raises(ValueError, match="cannot honour"):
            attend(*_as_bhsd(q, k, v), spec, None, kern)
        return
    for info in (None, MaskInfo(q_pos=pos, k_pos=pos, key_keep=keep, q_seg=seg, k_seg=seg)):
        qb, kb, vb = (t.requires_grad_(True) for t in _as_bhsd(q, k, v))
        out = attend(qb, kb, vb, spec, info, kern)
        grad = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (qb, kb, vb), grad)
        rq, rk, rv = (t.detach().clone().requires_grad_(True) for t in (qb, kb, vb))
        ref, _ = math_attention(rq, rk, rv, spec, info)
        rdq, rdk, rdv = torch.autograd.grad(ref, (rq, rk, rv), grad)
        for a, b in ((out, ref), (dq, rdq), (dk, rdk), (dv, rdv)):
            assert (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("kernel", ["reference", "flash_cpu"])
def test_lse_kernels_report_minus_inf_on_empty_rows(kernel):
    q, k, v, keep, _, _ = _inputs(seed=2)
    info = MaskInfo(key_keep=keep)
    out, lse = KERNELS[kernel].forward(*_as_bhsd(q, k, v), AttnSpec(causal=True), info)
    _, ref_lse = math_attention(*_as_bhsd(q, k, v), AttnSpec(causal=True), info)
    assert torch.isinf(lse[1, :, :3]).all() and (out[1, :, :3] == 0).all()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-12


def test_block_is_empty():
    def block_is_empty(spec, q_pos, k_pos):  # the ring skips a block when its plan is None
        return plan_block(spec, q_pos, k_pos) is None

    a, b = torch.arange(0, 4), torch.arange(4, 8)
    assert block_is_empty(AttnSpec(causal=True), a, b)
    assert not block_is_empty(AttnSpec(causal=True), b, a)
    assert block_is_empty(AttnSpec(causal=True, window=2), torch.arange(10, 12), a)
    assert not block_is_empty(AttnSpec(causal=False), a, b)
    assert block_is_empty(AttnSpec(window=1), a, b)
