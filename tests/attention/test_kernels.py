"""Local kernels against the oracle, and the oracle against a naive per-query loop: every option,
attention sinks (with their gradient), chunked attention, and a v head dim other than q's and k's."""

import math
import re

import pytest
import torch

from seqpar.attention import kernels
from seqpar.attention.blocks import plan_block
from seqpar.attention.kernels import KERNELS, attend, auto_kernel, lse_kernel_for
from seqpar.attention.reference import math_attention, reference_attention
from seqpar.attention.spec import AttnSpec, MaskInfo, position_mask
from seqpar.attention.varlen import mask_flag, plan_mask


def naive(q, k, v, *, causal, scale, window, softcap, keep, seg, pos, chunk=None, sinks=None):
    """One query at a time, straight from the definition. q, k [B,S,H(k),D], v [B,S,Hk,Dv]; the
    sink of head h is one more logit whose value vector is zero."""
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    out = torch.zeros(b, s, h, v.shape[3], dtype=q.dtype)
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
                    if chunk is not None and int(pos[i]) // chunk != int(pos[j]) // chunk:
                        continue
                    x = float(q[bi, i, hi] @ k[bi, j, hi // rep]) * scale
                    if softcap is not None:
                        x = softcap * math.tanh(x / softcap)
                    logits.append(x)
                    vals.append(v[bi, j, hi // rep])
                extra = [] if sinks is None else [float(sinks[hi])]
                if logits:
                    w = torch.softmax(torch.tensor(logits + extra, dtype=torch.float64), 0)[:len(logits)]
                    out[bi, i, hi] = sum(wj * vj for wj, vj in zip(w, vals, strict=True))
    return out


def _inputs(seed=0, b=2, s=9, h=4, hk=2, d=5, dv=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hk, dv, generator=g, dtype=torch.float64)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, 6:] = False
    keep[1, :3] = False  # left padding: with causal, rows 0-2 of batch 1 see nothing
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 2, 2, 3]])
    pos = torch.tensor([0, 8, 1, 7, 2, 6, 3, 5, 4])  # a permuted (zigzag-like) layout
    return q, k, v, keep, seg, pos


def _opts(causal, window=None, softcap=None, scale=None, chunk=None, sinks=False):
    return dict(causal=causal, window=window, softcap=softcap, scale=scale, chunk=chunk, sinks=sinks)


OPTIONS = [
    _opts(False),
    _opts(True, scale=0.7),
    _opts(True, window=3),
    _opts(False, window=2, softcap=1.5),
    _opts(True, softcap=2.0, scale=0.4),
    _opts(True, chunk=4),
    _opts(False, window=3, chunk=5, sinks=True),
    _opts(True, scale=0.6, sinks=True),
    _opts(True, softcap=2.0, chunk=3, sinks=True),
]
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)  # one per query head of _inputs


def _spec(opts, sinks=None):
    return AttnSpec(causal=opts["causal"], scale=opts["scale"], window=opts["window"], softcap=opts["softcap"],
                    chunk=opts["chunk"], sinks=sinks if opts["sinks"] else None)


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("masks", ["none", "keep", "seg", "keep+seg+pos"])
def test_reference_matches_naive_loop(opts, masks):
    q, k, v, keep, seg, pos = _inputs()
    keep = keep if "keep" in masks else None
    seg = seg if "seg" in masks else None
    positions = pos if "pos" in masks else None
    sinks = SINKS if opts["sinks"] else None
    kw = {n: opts[n] for n in ("causal", "scale", "window", "softcap", "chunk")}
    out, lse = reference_attention(q, k, v, key_padding_mask=keep, segment_ids=seg, positions=positions, sinks=sinks,
                                   **kw)
    scale = opts["scale"] or q.shape[-1] ** -0.5
    want = naive(q, k, v, causal=opts["causal"], scale=scale, window=opts["window"], softcap=opts["softcap"],
                 keep=keep, seg=seg, pos=positions if positions is not None else torch.arange(q.shape[1]),
                 chunk=opts["chunk"], sinks=sinks)
    assert (out - want).abs().max() < 1e-12
    assert not torch.isnan(lse).any()


def _as_bhsd(*ts):
    return [t.transpose(1, 2).contiguous() for t in ts]


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("kernel", ["reference", "flash_cpu", "tiled", "auto", "sdpa", "sdpa_dense"])
def test_kernel_forward_backward_vs_autograd_reference(opts, kernel):
    kern = KERNELS[kernel]
    local = kernel in ("sdpa", "sdpa_dense")  # no lse: sinks are not folded around them
    missing = _spec(opts, SINKS).options() - set(kern.supports) - (set() if local else {"sinks"})
    if missing:
        q, k, v = _inputs(seed=1)[:3]
        with pytest.raises(ValueError, match=re.escape(f"cannot honour {sorted(missing)}")):
            attend(*_as_bhsd(q, k, v), _spec(opts, SINKS), None, kern)
        return
    for dv_dim in (5, 3, 8):  # v's head dim: as q's and k's, smaller, larger (MLA)
        q, k, v, keep, seg, pos = _inputs(seed=1, dv=dv_dim)
        for info in (None, MaskInfo(q_pos=pos, k_pos=pos, key_keep=keep, q_seg=seg, k_seg=seg)):
            qb, kb, vb = (t.requires_grad_(True) for t in _as_bhsd(q, k, v))
            sinks = SINKS.clone().requires_grad_(True)
            spec = _spec(opts, sinks)
            inputs = (qb, kb, vb, sinks) if opts["sinks"] else (qb, kb, vb)
            if kernel == "sdpa" and mask_flag(spec, info, 9, 9, qb.device) is None:
                with pytest.raises(ValueError, match=r"kernel='sdpa' would need a dense \[B, 1, S, S\] mask"):
                    attend(qb, kb, vb, spec, info, kern)
                continue
            out = attend(qb, kb, vb, spec, info, kern)
            grad = torch.randn_like(out)
            grads = torch.autograd.grad(out, inputs, grad)
            ref_in = [t.detach().clone().requires_grad_(True) for t in inputs]
            ref_spec = _spec(opts, ref_in[3] if opts["sinks"] else None)
            ref, _ = math_attention(*ref_in[:3], ref_spec, info)
            ref_grads = torch.autograd.grad(ref, ref_in, grad)
            assert out.shape == (2, 4, 9, dv_dim)
            for a, b in ((out, ref), *zip(grads, ref_grads, strict=True)):
                assert (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("kernel", ["reference", "flash_cpu", "tiled"])
def test_lse_kernels_report_minus_inf_on_empty_rows(kernel):
    q, k, v, keep, _, _ = _inputs(seed=2)
    info = MaskInfo(key_keep=keep)
    out, lse = KERNELS[kernel].forward(*_as_bhsd(q, k, v), AttnSpec(causal=True), info)
    _, ref_lse = math_attention(*_as_bhsd(q, k, v), AttnSpec(causal=True), info)
    assert torch.isinf(lse[1, :, :3]).all() and (out[1, :, :3] == 0).all()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-12


def test_sinks_need_an_lse_kernel_and_pick_one_by_default():
    q = torch.zeros(1, 2, 3, 4)
    spec = AttnSpec(causal=True, sinks=torch.zeros(2))
    assert "sinks" in spec.options() and spec == AttnSpec(causal=True)  # an option set, not compared by value
    assert lse_kernel_for(q.device, q.dtype, spec) == "flash_cpu"
    assert lse_kernel_for(q.device, q.dtype, AttnSpec(softcap=2.0, sinks=torch.zeros(2))) == "tiled"
    with pytest.raises(ValueError, match=r"'sdpa' cannot honour \['sinks'\]"):
        attend(q, q, q, spec, None, KERNELS["sdpa"])


def test_chunk_mask_is_same_chunk_and_combines():
    pos = torch.arange(10)
    allowed = position_mask(AttnSpec(chunk=4), pos, pos)
    assert torch.equal(allowed, (pos[:, None] // 4) == (pos[None, :] // 4))
    both = position_mask(AttnSpec(causal=True, window=2, chunk=4), pos, pos)
    assert both[5].nonzero().flatten().tolist() == [4, 5] and both[4].nonzero().flatten().tolist() == [4]
    # a chunk holding the whole block hides nothing: the fused kernels keep their causal fast path
    assert plan_mask(AttnSpec(causal=True, chunk=16), None, 10, 10, pos.device) == (True, None)
    assert plan_mask(AttnSpec(chunk=16), MaskInfo(q_pos=pos + 6, k_pos=pos + 6), 10, 10, pos.device) == (False, None)
    causal, allowed = plan_mask(AttnSpec(causal=True, chunk=8), None, 10, 10, pos.device)
    assert not causal and torch.equal(allowed[0, 0], position_mask(AttnSpec(causal=True, chunk=8), pos, pos))


def test_block_is_empty():
    def block_is_empty(spec, q_pos, k_pos):  # the ring skips a block when its plan is None
        return plan_block(spec, q_pos, k_pos) is None

    a, b = torch.arange(0, 4), torch.arange(4, 8)
    assert block_is_empty(AttnSpec(causal=True), a, b)
    assert not block_is_empty(AttnSpec(causal=True), b, a)
    assert block_is_empty(AttnSpec(causal=True, window=2), torch.arange(10, 12), a)
    assert not block_is_empty(AttnSpec(causal=False), a, b)
    assert block_is_empty(AttnSpec(window=1), a, b)
    assert block_is_empty(AttnSpec(chunk=4), a, b) and not block_is_empty(AttnSpec(chunk=8), a, b)


def test_auto_picks_sdpa_only_where_its_flag_suffices(monkeypatch):
    """``auto`` on CPU: SDPA's flag for plain blocks, the varlen lse kernel for everything that
    would need a mask, softcap on ``tiled``; dropout on a masked block is sdpa_dense, said once."""
    q = torch.zeros(1, 2, 8, 4)
    pos = torch.arange(8)
    pad = MaskInfo(key_keep=torch.ones(1, 8, dtype=torch.bool))
    assert auto_kernel(q, AttnSpec(causal=True), None) == "sdpa"
    assert auto_kernel(q, AttnSpec(causal=True), MaskInfo(q_pos=pos, k_pos=pos)) == "sdpa"
    assert auto_kernel(q, AttnSpec(causal=True), MaskInfo(q_pos=pos.flip(0), k_pos=pos.flip(0))) == "flash_cpu"
    assert auto_kernel(q, AttnSpec(causal=True, window=3), None) == "flash_cpu"
    assert auto_kernel(q, AttnSpec(causal=True, window=8), None) == "sdpa"  # a window that cuts nothing
    assert auto_kernel(q, AttnSpec(causal=True), pad) == "flash_cpu"
    assert auto_kernel(q, AttnSpec(causal=True, sinks=torch.zeros(2)), None) == "flash_cpu"
    assert auto_kernel(q, AttnSpec(causal=True, softcap=2.0), None) == "tiled"
    assert auto_kernel(q, AttnSpec(causal=True, dropout=0.1), None) == "sdpa"
    with pytest.warns(UserWarning, match="sdpa_dense"):
        assert auto_kernel(q, AttnSpec(causal=True, dropout=0.1), pad) == "sdpa_dense"
    cuda = torch.device("cuda")
    monkeypatch.setenv("SEQPAR_GPU_RECORD", "/nonexistent/gpu_verified.json")  # no machine's record
    assert kernels.GPU_VERIFIED == {"cuda_flash"}  # its gpu-marked tests passed on an H200
    assert lse_kernel_for(cuda, torch.bfloat16, AttnSpec(causal=True, window=4)) == "cuda_flash"
    monkeypatch.setattr(kernels, "GPU_VERIFIED", frozenset())  # a kernel not yet run on a GPU is opt-in
    monkeypatch.setattr(kernels, "_warned", set())
    with pytest.warns(UserWarning, match="not been verified on a GPU"):  # said once, not per layer
        assert lse_kernel_for(cuda, torch.bfloat16, AttnSpec(causal=True, window=4)) == "tiled"
    assert lse_kernel_for(cuda, torch.float64, AttnSpec(causal=True)) == "tiled"
    monkeypatch.setattr(kernels, "GPU_VERIFIED", frozenset({"cuda_flash"}))
    assert lse_kernel_for(cuda, torch.float64, AttnSpec(causal=True)) == "tiled"
    assert "flex" not in kernels.GPU_VERIFIED  # built without a GPU: softcap stays on tiled, said once, flex opt-in
    monkeypatch.setattr(kernels, "_warned", set())
    with pytest.warns(UserWarning, match="flex has not been verified on a GPU"):
        assert lse_kernel_for(cuda, torch.float16, AttnSpec(softcap=3.0)) == "tiled"
    monkeypatch.setattr(kernels, "GPU_VERIFIED", frozenset({"cuda_flash", "flex"}))
    assert lse_kernel_for(cuda, torch.float16, AttnSpec(softcap=3.0)) == "flex"
    monkeypatch.setenv("SEQPAR_MEASURE_KERNELS", "0")  # unmeasured: the fixed order
    assert lse_kernel_for(cuda, torch.float16, AttnSpec(causal=True, window=4)) == "cuda_flash"  # still first
    monkeypatch.delenv("SEQPAR_MEASURE_KERNELS")  # measured: both honour the window (test_kernel_choice.py)
    assert lse_kernel_for(cuda, torch.float16, AttnSpec(causal=True, window=4)) == "fastest"
    assert lse_kernel_for(cuda, torch.float64, AttnSpec(softcap=3.0)) == "tiled"


def test_verify_names_the_cuda_kernels_not_yet_run_on_a_gpu(monkeypatch):
    from seqpar.cli.verify import cuda_note

    monkeypatch.setenv("SEQPAR_GPU_RECORD", "/nonexistent/gpu_verified.json")  # no machine's record
    note = cuda_note(1)
    assert "1 CUDA device(s)" in note and "make gpu-check" in note
    assert "opt-in: flex, cuda_cudnn" in note and "cuda_flash" not in note.split("opt-in")[1]
    monkeypatch.setattr(kernels, "GPU_VERIFIED", frozenset({"cuda_flash", "flex"}))
    assert "opt-in: cuda_cudnn" in cuda_note(1)
