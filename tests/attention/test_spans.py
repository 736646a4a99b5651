"""Bidirectional spans (Gemma 3's images, PaliGemma's prefix) as a mask feature: the block rule
against transformers' own, every CPU kernel against the float64 reference, block plans that never
hide a pair a span makes visible, and every strategy / layout over real gloo processes (P = 1..4,
float64 forward and backward at 1e-10), spans straddling shard boundaries."""

import warnings

import pytest
import torch

from seqpar.attention.blocks import plan_block, span_reach
from seqpar.attention.kernels import KERNELS
from seqpar.attention.reference import math_attention, reference_attention
from seqpar.attention.spec import AttnSpec, MaskInfo, dense_mask
from seqpar.attention.tiled import TiledKernel
from seqpar.comm.launch import run_distributed
from seqpar.testing.attention_parity import AttnCase, bad_rows, case_inputs, run_cases

TOL = 1e-10


def _blocks(b: int, s: int, seed: int) -> torch.Tensor:
    return case_inputs(AttnCase(seq=s, heads=1, kv_heads=1, batch=b, spans="images", seed=seed))["block_ids"]


def test_dense_rule_is_transformers_blockwise_overlay():
    """``causal OR same span``, window AND-ed (Gemma 3's sliding layers), from transformers' own mask
    functions evaluated pair by pair."""
    from transformers import masking_utils as mu

    s = 23
    blk = _blocks(2, s, 3)
    q = torch.arange(s)
    for window in (None, 4):
        spec = AttnSpec(causal=True, window=window)
        ours = dense_mask(spec, MaskInfo(q_blk=blk, k_blk=blk), s, s, torch.device("cpu"))[:, 0]  # [B, S, S]
        for row in range(2):
            fn = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blk[row:row + 1]))
            if window is not None:
                fn = mu.and_masks(mu.sliding_window_overlay(window), fn)
            theirs = torch.tensor([[bool(fn(0, 0, i, j)) for j in q] for i in q])
            assert torch.equal(ours[row], theirs)
        assert not torch.equal(ours, dense_mask(spec, None, s, s, torch.device("cpu"))[:, 0].expand_as(ours))


@pytest.mark.parametrize("spec", [AttnSpec(causal=True), AttnSpec(causal=True, window=5),
                                  AttnSpec(causal=True, chunk=8), AttnSpec(causal=False, window=6)],
                         ids=["causal", "window", "chunk", "bidir"])
@pytest.mark.parametrize("kernel", ["flash_cpu", "tiled", "tiled4", "reference"])
def test_kernels_honour_spans(kernel, spec):
    """Each CPU lse kernel (tiles of 4 too: spans across tiles) against the reference's math, with
    padding, packed documents and spans together (forward and backward, float64)."""
    g = torch.Generator().manual_seed(1)
    b, s = 2, 37
    q, k, v = (torch.randn(b, h, s, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    inputs = case_inputs(AttnCase(seq=s, heads=1, kv_heads=1, mask="packed", spans="prefix", seed=2))
    seg, blk = inputs["segment_ids"], inputs["block_ids"]
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, 33:] = False
    for mask in (MaskInfo(q_blk=_blocks(b, s, 4), k_blk=_blocks(b, s, 4)),
                 MaskInfo(q_seg=seg, k_seg=seg, key_keep=keep, q_blk=blk, k_blk=blk)):
        kern = KERNELS[kernel] if kernel != "tiled4" else TiledKernel()
        if kernel == "tiled4":
            kern.tile = 4
        ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref, _ = math_attention(*ref_in, spec, mask)
        dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        ref.backward(dout)
        out, lse = kern.forward(q, k, v, spec, mask)
        grads = kern.backward(dout, q, k, v, out, lse, spec, mask)
        assert (out - ref).abs().max() < TOL
        for got, want in zip(grads, ref_in, strict=True):
            assert (got - want.grad).abs().max() < TOL
        if spec.causal:  # the spans are not a no-op here
            plain = math_attention(q, k, v, spec, MaskInfo(q_seg=mask.q_seg, k_seg=mask.k_seg,
                                                           key_keep=mask.key_keep))[0]
            assert (plain - ref).abs().max() > 1e-3


def test_flex_and_sdpa_dense_honour_spans():
    """flex (uncompiled forward: all the CPU has) and sdpa_dense, through ``attend``."""
    g = torch.Generator().manual_seed(5)
    b, s = 2, 300  # more than flex's 128-token tiles: spans in tiles above the diagonal
    q, k, v = (torch.randn(b, h, s, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    blk = torch.full((b, s), -1, dtype=torch.long)
    blk[0, 100:260] = 0
    blk[1, 5:20] = 0
    blk[1, 120:140] = 1
    for spec in (AttnSpec(causal=True), AttnSpec(causal=True, window=50)):
        mask = MaskInfo(q_blk=blk, k_blk=blk)
        ref, ref_lse = math_attention(q, k, v, spec, mask)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "uncompiled flex builds the S x S scores": what a test wants here
            out, lse = KERNELS["flex"].forward(q, k, v, spec, mask)
        assert (out - ref).abs().max() < TOL and (lse - ref_lse).abs().max() < TOL
        out = KERNELS["sdpa_dense"](q, k, v, spec=spec, mask=mask)
        assert (out - ref).abs().max() < TOL


def test_sdpa_refuses_a_span_block():
    q = torch.randn(1, 2, 9, 4)
    blk = torch.tensor([[-1, 0, 0, 0, -1, -1, -1, -1, -1]])
    with pytest.raises(ValueError, match="kernel='sdpa' would need a dense"):
        KERNELS["sdpa"](q, q, q, spec=AttnSpec(causal=True), mask=MaskInfo(q_blk=blk, k_blk=blk))


def test_plans_keep_every_pair_a_span_shows():
    """A block plan (ring block or kernel tile) widened by :func:`span_reach` holds every visible
    pair; without spans it would skip or trim some (a span straddling the block boundary)."""
    g = torch.Generator().manual_seed(0)
    missed_without = 0
    for trial in range(60):
        s = int(torch.randint(4, 40, (1,), generator=g))
        perm = torch.randperm(s, generator=g)
        blk = _blocks(2, s, trial)
        a, b = sorted(torch.randint(0, s, (2,), generator=g).tolist())
        c, d = sorted(torch.randint(0, s, (2,), generator=g).tolist())
        q_pos, k_pos = perm[a:b + 1], perm[c:d + 1]
        for spec in (AttnSpec(causal=True), AttnSpec(causal=True, window=3), AttnSpec(causal=True, chunk=5)):
            vis = dense_mask(spec, MaskInfo(q_pos=q_pos, k_pos=k_pos, q_blk=blk[:, perm[a:b + 1]],
                                            k_blk=blk[:, perm[c:d + 1]]), len(q_pos), len(k_pos), q_pos.device)
            vis = vis[:, 0].any(dim=0)  # [Sq, Sk]: visible in some row
            reach = span_reach(q_pos, k_pos, blk[:, perm[a:b + 1]], blk[:, perm[c:d + 1]])
            for widened in (True, False):
                plan = plan_block(spec, q_pos, k_pos, reach if widened else None)
                inside = torch.zeros_like(vis)
                if plan is not None:
                    (r0, nr), (c0, nc) = plan.rows, plan.cols
                    inside[r0:r0 + nr, c0:c0 + nc] = True
                if widened:
                    assert not (vis & ~inside).any(), (trial, spec)
                else:
                    missed_without += int((vis & ~inside).any())
    assert missed_without > 0  # the widening is needed: the grid has straddling spans


def test_reference_attention_takes_block_ids():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 11, h, 4, generator=g, dtype=torch.float64) for h in (2, 1, 1))
    blk = _blocks(2, 11, 0)
    out, _ = reference_attention(q, k, v, causal=True, block_ids=blk)
    want, _ = math_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), AttnSpec(causal=True),
                             MaskInfo(q_blk=blk, k_blk=blk))
    assert torch.equal(out, want.transpose(1, 2))


# --------------------------------------------------------------------------------------------
# every strategy, layout and CPU kernel over gloo processes
# --------------------------------------------------------------------------------------------

def _c(strategy, kernel="reference", spans="images", mask="none", seq=37, heads=(8, 2), **kw):
    return AttnCase(seq=seq, heads=heads[0], kv_heads=heads[1], causal=True, mask=mask, spans=spans,
                    strategy=strategy, kernel=kernel, **kw)


QUICK = (
    [_c("ulysses", k, sp, m) for k, sp, m in (("reference", "images", "pad"), ("auto", "prefix", "packed"),
                                              ("sdpa_dense", "images", "none"))]
    + [_c("ring", k, sp, m, options=o) for k, sp, m, o in (
        ("flash_cpu", "images", "pad", {"layout": "zigzag"}), ("reference", "prefix", "packed", {}),
        ("flash_cpu", "images", "none", {"layout": "contiguous", "comm": "allgather"}))]
    + [_c("ring:doc-zigzag", "flash_cpu", "prefix", "packed", window=5, heads=(6, 1)),
       _c("hybrid", "flash_cpu", "images", "pad", seq=29, options={"layout": "zigzag"})]
)


def _heavy_cases() -> list[AttnCase]:
    """Every strategy, layout and CPU kernel with both kinds of spans, window or not, on every mask."""
    ring_ways = [("reference", {"layout": "contiguous"}), ("reference", {"layout": "zigzag"}),
                 ("flash_cpu", {"layout": "zigzag", "comm": "p2p"}),
                 ("flash_cpu", {"layout": "contiguous", "comm": "allgather"}), ("tiled", {"layout": "zigzag"})]
    cases = []
    for seq in (7, 37):
        for m in ("none", "pad", "packed"):
            for sp in ("images", "prefix"):
                for w in (None, 5):
                    cases += [_c("ulysses", k, sp, m, seq=seq, window=w, heads=(6, 1))
                              for k in ("reference", "auto", "flash_cpu", "tiled", "sdpa_dense")]
                    cases += [_c(st, k, sp, m, seq=seq, window=w, options=o) for st in ("ring", "hybrid")
                              for k, o in ring_ways]
                    cases += [_c(f"{st}:doc-zigzag", "flash_cpu", sp, m, seq=seq, window=w, heads=(6, 1))
                              for st in ("ulysses", "ring", "hybrid")]
    cases += [_c(st, "flash_cpu", sp, m, seq=129, options={"layout": "zigzag"} if st != "ulysses" else {})
              for st in ("ulysses", "ring", "hybrid") for sp in ("images", "prefix") for m in ("pad", "packed")]
    cases += [_c("ring", "tiled", "images", "pad", chunk=8, sinks=True, softcap=2.0, options={"layout": "zigzag"}),
              _c("ulysses", "tiled", "prefix", "packed", chunk=8, sinks=True, softcap=2.0),
              _c("hybrid", "flash_cpu", "images", "packed", chunk=8, sinks=True, v_head_dim=5)]
    return cases


def _worker(rank, world, cases):
    return run_cases(rank, world, cases)


@pytest.fixture(scope="module")
def quick_runs():
    return {p: run_distributed(_worker, p, QUICK, timeout=600)[0] for p in (1, 2, 3, 4)}


@pytest.mark.parametrize("p", [1, 2, 3, 4], ids=lambda p: f"P{p}")
def test_strategies_with_spans(quick_runs, p):
    rows = quick_runs[p]
    assert len(rows) == len(QUICK)
    assert not bad_rows(rows, TOL), bad_rows(rows, TOL)


@pytest.mark.heavy
@pytest.mark.parametrize("p", [1, 2, 3, 4], ids=lambda p: f"P{p}")
def test_every_strategy_layout_kernel_with_spans(p):
    cases = _heavy_cases()
    rows = run_distributed(_worker, p, cases, timeout=1800)[0]
    assert len(rows) == len(cases)
    assert not bad_rows(rows, TOL), bad_rows(rows, TOL)


def test_quick_grid_has_spans_straddling_shards():
    """The quick grid's image spans cross a shard boundary of the contiguous split at every P > 1
    (and so a ring block boundary: a "future" block some span makes visible)."""
    from seqpar.attention.layout import layout_seq_lens

    for p in (2, 3, 4):
        crossing = 0
        for case in QUICK:
            if case.spans != "images":
                continue
            blk = case_inputs(case)["block_ids"]
            bounds = torch.tensor(layout_seq_lens(case.seq, p)).cumsum(0)[:-1]
            for row in blk:
                for span in row[row >= 0].unique():
                    where = (row == span).nonzero().flatten()
                    crossing += int(((bounds > where.min()) & (bounds <= where.max())).any())
        assert crossing > 0, p


def test_cuda_span_tiles_plumbing_on_meta_tensors():
    """No GPU needed: a span tile of the CUDA kernels goes to the memory-efficient op with the
    tile's span-aware bias (the aten meta kernels check every argument), forward and backward."""
    from seqpar.attention.cuda import CudaFlashKernel, CudnnKernel, uses_flash

    pos = torch.arange(37, device="meta")
    blk = (torch.zeros(37, dtype=torch.long, device="meta"),) * 2
    assert not uses_flash("positions", torch.bfloat16, 16)  # span tiles are "positions" tiles
    for kern, dtype in ((CudaFlashKernel(), torch.bfloat16), (CudnnKernel(), torch.float16),
                        (CudaFlashKernel(), torch.float32)):
        q = torch.empty(2, 4, 37, 12, device="meta", dtype=dtype)
        k = torch.empty(2, 2, 37, 12, device="meta", dtype=dtype)
        spec = AttnSpec(causal=True, window=4)
        out, lse = kern.tile_forward(q, k, k, spec, "positions", pos, pos, blk)
        assert out.shape == q.shape and lse.shape == (2, 4, 37)
        grads = kern.tile_backward(out, q, k, k, out, lse, spec, "positions", pos, pos, blk)
        assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["cuda_flash", "cuda_cudnn", "tiled", "flex"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_kernels_honour_spans(name, dtype):
    """On a GPU: each kernel with spans (padding, documents, a permuted layout, a window) against
    the float64 oracle, within twice torch's own SDPA with the dense mask in the same dtype plus
    float32 merge rounding -- the dtype's floor, measured (as test_lse_kernels' GPU test)."""
    if name == "cuda_cudnn" and dtype == torch.float32:
        pytest.skip("cuDNN takes half-precision tiles only")
    from seqpar.attention.layout import layout_permutation

    g = torch.Generator().manual_seed(0)
    s = 300
    q, k, v = (torch.randn(2, h, s, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    seg = torch.sort(torch.randint(0, 3, (2, s), generator=g), dim=1).values
    keep = torch.ones(2, s, dtype=torch.bool)
    keep[1, -37:] = False
    pos = layout_permutation(s, 3, "zigzag")
    blk = torch.full((2, s), -1, dtype=torch.long)
    blk[:, 40:180], blk[0, 200:260], blk[1, 5:9] = 0, 1, 2  # in layout order: spans cut by the permutation
    failures = []
    for spec, mask in ((AttnSpec(causal=True), MaskInfo(q_pos=pos, k_pos=pos, key_keep=keep, q_seg=seg, k_seg=seg,
                                                        q_blk=blk, k_blk=blk)),
                       (AttnSpec(causal=True, window=41), MaskInfo(q_blk=blk, k_blk=blk))):
        ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want, want_lse = math_attention(*ref_in, spec, mask)
        dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
        want.backward(dout)
        cuda = MaskInfo(**{f: None if t is None else t.cuda() for f, t in zip(
            ("q_pos", "k_pos", "key_keep", "q_seg", "k_seg", "q_blk", "k_blk"), mask.tensors(), strict=True)})
        qc, kc, vc, dc = (t.to("cuda", dtype) for t in (q, k, v, dout))
        kern = KERNELS[name]
        out, lse = kern.forward(qc, kc, vc, spec, cuda)
        grads = kern.backward(dc, qc, kc, vc, out, lse, spec, cuda)
        ins = [t.detach().clone().requires_grad_(True) for t in (qc, kc, vc)]
        allowed = dense_mask(spec, cuda, s, s, qc.device)
        seen = allowed.any(-1, keepdim=True)
        peer = torch.nn.functional.scaled_dot_product_attention(*ins, attn_mask=allowed | ~seen, enable_gqa=True)
        peer = peer * seen
        peer_grads = torch.autograd.grad(peer, ins, dc)
        for what, ours, theirs, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (peer, *peer_grads),
                                           (want, *(t.grad for t in ref_in)), strict=True):
            e_ours = float((ours.double().cpu() - ref).abs().max())
            e_peer = float((theirs.double().cpu() - ref).abs().max())
            if e_ours > 2 * e_peer + 8 * torch.finfo(torch.float32).eps * float(ref.abs().max()):
                failures.append((name, spec, what, e_ours, e_peer))
    assert not failures, failures
