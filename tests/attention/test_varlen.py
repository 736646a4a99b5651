"""Document rectangles (seqpar.attention.varlen): against the dense mask, every visible query-key
pair lies in exactly one rectangle, rectangles never overlap, and each says truthfully how it must
be masked -- for padding, packing, causal, window, chunk and permuted (zigzag-like) positions."""

import itertools

import pytest
import torch

from seqpar.attention.spec import AttnSpec, MaskInfo, dense_mask
from seqpar.attention.varlen import document_rects


def _inputs(seed, sq, sk, batch, permuted):
    g = torch.Generator().manual_seed(seed)
    seg = torch.sort(torch.randint(0, 4, (batch, max(sq, sk)), generator=g), dim=1).values
    keep = torch.rand(batch, sk, generator=g) > 0.25
    pos = torch.randperm(max(sq, sk), generator=g) if permuted else torch.arange(max(sq, sk))
    return seg, keep, pos


@pytest.mark.parametrize("causal,window,chunk,permuted", [
    *itertools.product((True, False), (None, 3), (None, 4), (False,)), (True, None, None, True), (True, 5, None, True)])
def test_rectangles_cover_each_visible_pair_once(causal, window, chunk, permuted):
    spec = AttnSpec(causal=causal, window=window, chunk=chunk)
    for seed, (sq, sk) in enumerate([(13, 13), (7, 11), (16, 16), (1, 5)]):
        seg, keep, pos = _inputs(seed, sq, sk, 3, permuted)
        for use_seg, use_keep in ((True, False), (False, True), (True, True)):
            mask = MaskInfo(q_pos=pos[:sq], k_pos=pos[:sk], key_keep=keep if use_keep else None,
                            q_seg=seg[:, :sq] if use_seg else None, k_seg=seg[:, :sk] if use_seg else None)
            visible = dense_mask(spec, mask, sq, sk, torch.device("cpu")).expand(3, 1, sq, sk)[:, 0]  # [B, Sq, Sk]
            covered = torch.zeros(3, sq, sk, dtype=torch.long)
            for r in document_rects(spec, mask, sq, sk, 3):
                (q0, nq), (k0, nk) = r.q, r.k
                box = visible[r.row, q0:q0 + nq, k0:k0 + nk]
                covered[r.row, q0:q0 + nq, k0:k0 + nk] += 1
                assert box.any(), r  # nothing computed that nothing sees
                if r.how == "none":
                    assert box.all(), r
                elif r.how == "causal":
                    assert nq == nk and torch.equal(box, torch.ones(nq, nk, dtype=torch.bool).tril()), r
            assert covered.max() <= 1  # no pair computed twice
            assert torch.equal(covered.bool() & visible, visible)  # every visible pair computed


def test_long_documents_get_the_causal_flag_not_a_mask():
    """A packed row of long documents under causal attention: one causal rectangle per document."""
    seg = torch.repeat_interleave(torch.arange(4), 1024)[None]  # [1, 4096]
    rects = document_rects(AttnSpec(causal=True), MaskInfo(q_seg=seg, k_seg=seg), 4096, 4096, 1)
    assert [(r.q, r.k, r.how) for r in rects] == [((i * 1024, 1024), (i * 1024, 1024), "causal") for i in range(4)]


def test_long_blocks_are_tiled():
    """One 4096-token causal document, tile 1024: the 4 diagonal tiles with the causal flag, the 6
    below it whole, none above -- no kernel call sees more than 1024 x 1024."""
    rects = document_rects(AttnSpec(causal=True), None, 4096, 4096, 2, tile=1024)
    assert all(r.row is None for r in rects)  # no padding, no documents: every row alike
    assert sorted((r.q[0] // 1024, r.k[0] // 1024, r.how) for r in rects) == sorted(
        [(i, i, "causal") for i in range(4)] + [(i, j, "none") for i in range(4) for j in range(i)])
    assert max(max(r.q[1], r.k[1]) for r in rects) == 1024


def test_tiles_cover_each_visible_pair_once():
    spec = AttnSpec(causal=True, window=37)
    seg, keep, pos = _inputs(3, 200, 200, 2, permuted=False)
    mask = MaskInfo(q_pos=pos, k_pos=pos, key_keep=keep, q_seg=seg, k_seg=seg)
    visible = dense_mask(spec, mask, 200, 200, torch.device("cpu"))[:, 0]
    covered = torch.zeros(2, 200, 200, dtype=torch.long)
    for r in document_rects(spec, mask, 200, 200, 2, tile=16):
        assert r.q[1] <= 16 and r.k[1] <= 16
        covered[r.row, r.q[0]:r.q[0] + r.q[1], r.k[0]:r.k[0] + r.k[1]] += 1
    assert covered.max() <= 1 and torch.equal(covered.bool() & visible, visible)


class _Largest(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most elements any single op output has."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("kernel", ["auto", "flash_cpu", "tiled"])
def test_no_tensor_grows_with_the_square_of_the_length(kernel):
    """Forward and backward of one 4096-token block -- packed documents, padding, a window on a
    permuted (zigzag) layout -- never allocate anything near ``S x S`` (16M elements): the largest
    tensor is a tile's scores or mask, at most ``H x 1024 x 1024`` = 2M elements (sdpa_dense's
    mask alone is 16M)."""
    from seqpar.attention.kernels import KERNELS, attend
    from seqpar.attention.layout import layout_permutation

    s, g = 4096, torch.Generator().manual_seed(0)
    docs = torch.repeat_interleave(torch.arange(8), torch.full((8,), 512))[None]  # [1, S]
    keep = torch.ones(1, s, dtype=torch.bool)
    keep[:, -700:] = False
    zigzag = layout_permutation(s, 4, "zigzag")
    cases = [(AttnSpec(causal=True), MaskInfo(q_seg=docs, k_seg=docs)),
             (AttnSpec(causal=True), MaskInfo(key_keep=keep)),
             (AttnSpec(causal=True, window=300), MaskInfo(q_pos=zigzag, k_pos=zigzag))]
    if kernel == "tiled":
        cases = [(AttnSpec(causal=True, softcap=5.0), MaskInfo(q_seg=docs, k_seg=docs))]
    for spec, mask in cases:
        q, k, v = (torch.randn(1, h, s, 8, generator=g, requires_grad=True) for h in (2, 1, 1))
        with _Largest() as probe:
            out = attend(q, k, v, spec, mask, KERNELS[kernel])
            out.sum().backward()
        assert probe.most <= 2 * 1024 * 1024, (spec, probe.most)  # S * S / 8


def test_a_batch_is_planned_once(monkeypatch):
    """Every layer's forward and backward on the same batch's masks reuse the first plan; a new
    batch (a new SeqShard) is planned anew, and a plan goes when its batch does."""
    import weakref

    from seqpar.attention import varlen
    from seqpar.attention.kernels import KERNELS, attend
    from seqpar.attention.shard import SeqShard

    calls = []
    real = varlen._document_rects
    monkeypatch.setattr(varlen, "_document_rects", lambda *a: calls.append(1) or real(*a))
    seg = torch.repeat_interleave(torch.arange(3), 5)[None]  # [1, 15]
    shard = SeqShard((15,), segments=seg)
    for _ in range(3):  # three layers
        q = torch.randn(1, 2, 15, 4, requires_grad=True)
        attend(q, q, q, AttnSpec(causal=True), shard.mask(), KERNELS["flash_cpu"]).sum().backward()
    assert len(calls) == 1
    other = SeqShard((15,), segments=seg.clone())
    document_rects(AttnSpec(causal=True), other.mask(), 15, 15, 1)
    assert len(calls) == 2
    state = weakref.ref(other.state)
    del other
    assert state() is None  # freed with its batch at once: nothing holds it in a cycle
    # a mask built outside a batch's SeqShard is planned per call, and nothing is kept for it
    document_rects(AttnSpec(causal=True), MaskInfo(q_seg=seg, k_seg=seg), 15, 15, 1)
    document_rects(AttnSpec(causal=True), MaskInfo(q_seg=seg, k_seg=seg), 15, 15, 1)
    assert len(calls) == 4
