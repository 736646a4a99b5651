"""The ring's fused fast path (issue 27): a block that is full or the plain causal diagonal runs the
kernel's fused op once, with no mask and no document-rectangle planning; other blocks keep the
rectangles. Pure: which blocks are fused (the plans), and that a fused block's result is the
rectangles' result (float64, flash_cpu against the rectangle loop and the reference). In one
process on torch's fake process group (rank 1 of 4, collectives move nothing): which op each
block of a real ring call runs, and that planning happens once per batch across layers and the
backward. The ring's float64 exactness over real ranks is tests/attention/test_ring.py's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from seqpar import compat
from seqpar.attention import rect_kernel, ring_loop
from seqpar.attention.blocks import RingStats
from seqpar.attention.kernels import KERNELS
from seqpar.attention.layout import layout_permutation
from seqpar.attention.shard import SeqShard
from seqpar.attention.spec import AttnSpec

P, N = 4, 6  # ranks, tokens per rank


def _shard(layout: str, **masks) -> SeqShard:
    perm = None if layout == "contiguous" else layout_permutation(P * N, P, layout)
    return SeqShard((N,) * P, perm, **masks)


def _kinds(shard: SeqShard, spec: AttnSpec, me: int) -> list[str | None]:
    return ["skip" if p is None else p.fused for p in ring_loop.block_plans(shard, spec, me)]


@pytest.mark.parametrize("me", range(P))
def test_every_zigzag_causal_block_is_fused_its_own_block_causal(me):
    kinds = _kinds(_shard("zigzag"), AttnSpec(causal=True), me)
    assert kinds == ["causal" if r == me else "full" for r in range(P)]


def test_contiguous_causal_blocks_are_diagonal_below_and_skipped_above():
    kinds = _kinds(_shard("contiguous"), AttnSpec(causal=True), 1)
    assert kinds == ["full", "causal", "skip", "skip"]
    assert _kinds(_shard("zigzag"), AttnSpec(causal=False), 2) == ["full"] * P


def test_blocks_that_need_a_mask_keep_the_rectangles():
    pad = torch.ones(2, P * N, dtype=torch.bool)
    pad[0, -2:] = False
    seg = torch.zeros(2, P * N, dtype=torch.long)
    seg[:, 10:] = 1
    causal = AttnSpec(causal=True)
    assert set(_kinds(_shard("zigzag", key_keep=pad), causal, 1)) == {None}  # padding
    assert set(_kinds(_shard("zigzag", segments=seg), causal, 1)) == {None}  # packed documents
    # a window that cuts the diagonal block: rectangles there; blocks it hides are skipped
    windowed = _kinds(_shard("contiguous"), AttnSpec(causal=True, window=4), 2)
    assert windowed[2] is None and windowed[3] == "skip"


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_fused_block_is_exactly_the_rectangles_and_the_reference(layout):
    """float64: each fused block's (out, lse) and gradients against the same block through the
    rectangle loop with its mask, and through the reference kernel."""
    torch.manual_seed(0)
    shard, spec, me = _shard(layout), AttnSpec(causal=True), 2
    flash, ref = KERNELS["flash_cpu"], KERNELS["reference"]
    fused_seen = 0
    for owner, plan in enumerate(ring_loop.block_plans(shard, spec, me)):
        if plan is None or plan.fused is None:
            continue
        fused_seen += 1
        (r0, nr), (c0, nc) = plan.rows, plan.cols
        q = torch.randn(2, 6, nr, 8, dtype=torch.float64)
        k, v = (torch.randn(2, 2, nc, 8, dtype=torch.float64) for _ in range(2))  # GQA: 6 query / 2 KV heads
        mask = shard.mask((shard.local_range(me)[0] + r0, nr), (shard.local_range(owner)[0] + c0, nc))
        causal = plan.fused == "causal"
        out, lse = flash.fused_forward(q, k, v, spec, causal)
        for kernel in (flash, ref):
            want_out, want_lse = kernel.forward(q, k, v, spec, mask)
            torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
            torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
        dout = torch.randn_like(out)
        grads = flash.fused_backward(dout, q, k, v, out, lse, spec, causal)
        for kernel in (flash, ref):
            for got, want in zip(grads, kernel.backward(dout, q, k, v, out, lse, spec, mask), strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert fused_seen == (P if layout == "zigzag" else 3)


def test_fused_default_of_any_lse_kernel_is_its_forward_without_a_mask():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    tiled, spec = KERNELS["tiled"], AttnSpec(causal=True, window=100)
    for causal in (False, True):
        out, lse = tiled.fused_forward(q, k, v, spec, causal)
        want = KERNELS["reference"].forward(q, k, v, replace(spec, causal=causal, window=None), None)
        torch.testing.assert_close(out, want[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(lse, want[1], rtol=0, atol=1e-12)


def _recording(monkeypatch) -> Counter:
    """Count the fused CPU op's calls by causal flag, the ring's plans and the kernels' rectangles."""
    calls: Counter = Counter()

    def wrap(owner, name, key):
        fn = getattr(owner, name)

        def counted(*args, **kwargs):
            calls[key(args)] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)

    wrap(compat, "cpu_flash_attention", lambda a: f"forward causal={a[4]}")
    wrap(compat, "cpu_flash_attention_backward", lambda a: f"backward causal={a[7]}")
    wrap(ring_loop, "plan_block", lambda a: "plan_block")
    wrap(rect_kernel, "document_rects", lambda a: "document_rects")
    return calls


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_call_runs_one_fused_op_per_block_and_plans_once_per_batch(monkeypatch, layout):
    """Rank 1 of 4, three layers and the backward of one batch: each block is one call of the CPU
    fused op with the plan's causal flag, no rectangle is planned, the ring's plans are made once."""
    import torch.distributed as dist

    from seqpar.attention.ring import ring_attention

    calls = _recording(monkeypatch)
    torch.manual_seed(2)
    with compat.fake_process_group(1, P):
        shard = _shard(layout)
        x = torch.randn(2, N, 4, 8, dtype=torch.float64, requires_grad=True)  # [B, S/P, H, D]
        stats, y = RingStats(), x
        for layer in range(3):
            y = ring_attention(y, y[:, :, :2], y[:, :, :2], group=dist.group.WORLD, causal=True, shard=shard,
                               validate=False, kernel="flash_cpu", stats=stats if layer == 0 else None)
        y.sum().backward()
    fused = {"zigzag": {"fused causal": 1, "fused full": 3}, "contiguous": {"fused causal": 1, "fused full": 1}}
    assert stats.ops == fused[layout] and stats.skipped == P - stats.blocks
    n_full, n_causal = (3, 1) if layout == "zigzag" else (1, 1)
    assert calls == Counter({"plan_block": P, "forward causal=True": 3 * n_causal, "forward causal=False": 3 * n_full,
                             "backward causal=True": 3 * n_causal, "backward causal=False": 3 * n_full})


def test_padded_batch_keeps_the_rectangles(monkeypatch):
    import torch.distributed as dist

    from seqpar.attention.ring import ring_attention

    calls = _recording(monkeypatch)
    keep = torch.ones(2, P * N, dtype=torch.bool)
    keep[1, :3] = False
    with compat.fake_process_group(1, P):
        stats = RingStats()
        x = torch.randn(2, N, 2, 8, dtype=torch.float64)
        ring_attention(x, x, x, group=dist.group.WORLD, causal=True, shard=_shard("zigzag", key_keep=keep),
                       validate=False, kernel="flash_cpu", stats=stats)
    assert stats.ops == {"rectangles": P} and calls["document_rects"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fused_blocks_match_the_oracle(dtype):
    """cuda_flash's fused block (repeated K/V, and native GQA) against the float64 reference: within
    twice the error of the rectangle loop on the same block in the same dtype, plus 8 float32 ulp."""
    from seqpar.attention.cuda import CudaFlashKernel

    torch.manual_seed(3)
    spec, ref, failures = AttnSpec(causal=True), KERNELS["reference"], []
    for causal in (True, False):
        q = torch.randn(2, 8, 300, 128, dtype=torch.float64, device="cuda")
        k, v = (torch.randn(2, 2, 300, 128, dtype=torch.float64, device="cuda") for _ in range(2))
        dout = torch.randn_like(q)
        plain = replace(spec, causal=causal)
        want_out, want_lse = ref.forward(q, k, v, plain, None)
        want = (want_out, *ref.backward(dout, q, k, v, want_out, want_lse, plain, None))
        low = [t.to(dtype) for t in (q, k, v, dout)]
        rect = KERNELS["cuda_flash"]
        o, lse = rect.forward(*low[:3], plain, None)
        floor = (o, *rect.backward(low[3], *low[:3], o, lse, plain, None))
        for kernel in (KERNELS["cuda_flash"], CudaFlashKernel(native_gqa=True)):
            o, lse = kernel.fused_forward(*low[:3], spec, causal)
            got = (o, *kernel.fused_backward(low[3], *low[:3], o, lse, spec, causal))
            for name, g, f, w in zip(("out", "dq", "dk", "dv"), got, floor, want, strict=True):
                ours, theirs = float((g.double() - w).abs().max()), float((f.double() - w).abs().max())
                if not ours <= 2 * theirs + 8 * torch.finfo(torch.float32).eps * float(w.abs().max()):
                    failures.append((kernel.native_gqa, causal, name, ours, theirs))
    assert not failures, failures
