"""The varlen lse kernels as ring blocks: split a row's keys into blocks with offset and permuted
positions, run each block's forward, merge, then each block's backward with the merged out and lse
-- the sum must be the float64 oracle's gradient. On CPU (flash_cpu, tiled) always; on CUDA
(cuda_flash, tiled; marked ``gpu``, skipped without CUDA) against the same float64 oracle, within
the error torch's own SDPA makes in the same dtype. Plus the CUDA ops' plumbing on meta tensors,
which needs no GPU."""

import itertools

import pytest
import torch

from seqpar.attention.blocks import merge_partials
from seqpar.attention.cuda import CudaFlashKernel
from seqpar.attention.kernels import KERNELS
from seqpar.attention.layout import layout_permutation
from seqpar.attention.reference import math_attention
from seqpar.attention.spec import AttnSpec, MaskInfo, acc_dtype

CUDA = torch.cuda.is_available()


def _case(seed, device, dtype, *, s=300, h=4, hk=2, d=16, dv=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, hh, s, dd, generator=g, dtype=torch.float64) for hh, dd in ((h, d), (hk, d), (hk, dv)))
    seg = torch.sort(torch.randint(0, 5, (2, s), generator=g), dim=1).values  # packed documents
    keep = torch.ones(2, s, dtype=torch.bool)
    keep[1, -37:] = False  # right padding on row 1
    pos = layout_permutation(s, 3, "zigzag")  # permuted (ring layout) positions
    return [t.to(device, dtype) for t in (q, k, v)], seg.to(device), keep.to(device), pos.to(device)


def _masks(seg, keep, pos):
    yield AttnSpec(causal=True), MaskInfo(q_pos=pos, k_pos=pos, key_keep=keep, q_seg=seg, k_seg=seg)
    yield AttnSpec(causal=True, window=41), MaskInfo(q_pos=pos, k_pos=pos)
    yield AttnSpec(causal=True), MaskInfo(key_keep=keep)
    yield AttnSpec(), MaskInfo(q_seg=seg, k_seg=seg)


def _ring_style(kernel, q, k, v, spec, mask, dout, blocks=3):
    """Forward per key block (offset, permuted positions), lse merge, backward per block with the
    merged out and lse; returns out, lse and the summed (dq, dk, dv)."""
    sk = k.shape[2]
    q_pos, k_pos = mask.positions(q.shape[2], sk, q.device)
    cuts = [round(i * sk / blocks) for i in range(blocks + 1)]
    acc = acc_dtype(q.dtype)
    out = torch.zeros((*q.shape[:3], v.shape[3]), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)

    def block(a, b):
        cut = (lambda t: None if t is None else t[:, a:b])
        return MaskInfo(q_pos=q_pos, k_pos=k_pos[a:b], key_keep=cut(mask.key_keep), q_seg=mask.q_seg,
                        k_seg=cut(mask.k_seg))

    for a, b in itertools.pairwise(cuts):
        o_b, l_b = kernel.forward(q, k[:, :, a:b], v[:, :, a:b], spec, block(a, b))
        out, lse = merge_partials(out, lse, o_b, l_b)
    out = out.to(q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b in itertools.pairwise(cuts):
        g = kernel.backward(dout, q, k[:, :, a:b], v[:, :, a:b], out, lse, spec, block(a, b))
        dq += g[0]
        dk[:, :, a:b] += g[1]
        dv[:, :, a:b] += g[2]
    return out, lse, (dq, dk, dv)


def _oracle(q, k, v, spec, mask, dout):
    ins = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    cpu = MaskInfo(*(None if t is None else t.cpu() for t in (mask.q_pos, mask.k_pos, mask.key_keep, mask.q_seg,
                                                              mask.k_seg)))
    out, lse = math_attention(*ins, spec, cpu)
    return out.detach(), lse.detach(), torch.autograd.grad(out, ins, dout.double().cpu())


def _errors(got_out, got_lse, got_grads, want_out, want_lse, want_grads):
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(got_lse.cpu()))
    errs = [(got_out.double().cpu() - want_out).abs().max(),
            (got_lse.double().cpu()[finite] - want_lse[finite]).abs().max()]
    errs += [(a.double().cpu() - b).abs().max() for a, b in zip(got_grads, want_grads, strict=True)]
    return [float(e) for e in errs]


@pytest.mark.parametrize("name", ["flash_cpu", "tiled"])
@pytest.mark.parametrize("dv", [16, 8])
def test_cpu_kernels_as_ring_blocks_are_exact(name, dv):
    (q, k, v), seg, keep, pos = _case(0, "cpu", torch.float64, dv=dv)
    for spec, mask in _masks(seg, keep, pos):
        dout = torch.randn(q.shape[:3] + (dv,), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        got = _ring_style(KERNELS[name], q, k, v, spec, mask, dout)
        assert max(_errors(*got, *_oracle(q, k, v, spec, mask, dout))) < 1e-10, spec


def test_cuda_ops_plumbing_on_meta_tensors():
    """No GPU needed: the aten CUDA ops' meta kernels check every argument and give the shapes, so
    both paths (FlashAttention for unmasked half-precision tiles, memory-efficient with a tile mask
    otherwise), GQA, a v head dim other than q's and the backward's arguments are exercised."""
    kern = CudaFlashKernel()
    pos = torch.arange(37, device="meta")
    for dtype, how in itertools.product((torch.bfloat16, torch.float32), ("none", "causal", "positions")):
        q = torch.empty(2, 4, 37, 12, device="meta", dtype=dtype)
        k = torch.empty(2, 2, 37, 12, device="meta", dtype=dtype)
        v = torch.empty(2, 2, 37, 5, device="meta", dtype=dtype)
        spec = AttnSpec(causal=True, window=4)
        out, lse = kern.tile_forward(q, k, v, spec, how, pos, pos)
        assert out.shape == (2, 4, 37, 5) and lse.shape == (2, 4, 37)
        grads = kern.tile_backward(out, q, k, v, out, lse, spec, how, pos, pos)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["cuda_flash", "tiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernels_as_ring_blocks_match_the_oracle(name, dtype):
    """Errors against the float64 oracle within twice those of torch's own SDPA (dense mask) in the
    same dtype, plus float32 rounding of the merge (8 ulp of float32 at the oracle's largest value:
    the tiles' and blocks' partial results are merged and summed in float32) -- the dtype's floor,
    measured, not assumed. Every case and tensor is checked; the failures are reported together."""
    from seqpar.attention.spec import dense_mask

    (q, k, v), seg, keep, pos = _case(0, "cuda", dtype)
    failures = []
    g = torch.Generator().manual_seed(1)
    for spec, mask in _masks(seg, keep, pos):
        dout = torch.randn(q.shape[:3] + (v.shape[3],), generator=g).to("cuda", dtype)
        want = _oracle(q, k, v, spec, mask, dout)
        got = _errors(*_ring_style(KERNELS[name], q, k, v, spec, mask, dout), *want)
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        allowed = dense_mask(spec, mask, q.shape[2], k.shape[2], q.device)
        seen = allowed.any(-1, keepdim=True)
        peer = torch.nn.functional.scaled_dot_product_attention(*ins, attn_mask=allowed | ~seen, enable_gqa=True)
        peer = peer * seen
        peer_grads = torch.autograd.grad(peer, ins, dout)
        floor = _errors(peer, want[1].to("cuda"), peer_grads, *want)  # lse: the oracle's own (no SDPA lse)
        largest = [float(t.abs().max()) for t in (want[0], want[1][torch.isfinite(want[1])], *want[2])]
        for i, (ours, theirs, big) in enumerate(zip(got, floor, largest, strict=True)):
            if i == 1:
                ok = ours < 1e-2 if dtype != torch.float32 else ours < 1e-5
            else:
                ok = ours <= 2 * theirs + 8 * torch.finfo(torch.float32).eps * big
            if not ok:
                failures.append((spec, ["out", "lse", "dq", "dk", "dv"][i], ours, theirs))
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_tiled_on_cuda_in_float64_is_exact():
    (q, k, v), seg, keep, pos = _case(0, "cuda", torch.float64)
    for spec, mask in _masks(seg, keep, pos):
        dout = torch.randn(q.shape[:3] + (v.shape[3],), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        dout = dout.to("cuda")
        got = _ring_style(KERNELS["tiled"], q, k, v, spec, mask, dout)
        assert max(_errors(*got, *_oracle(q, k, v, spec, mask, dout))) < 1e-10, spec
