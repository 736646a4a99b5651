"""Ring attention's pure parts, no processes: block plans (skip / trim, causal, window, chunk) against
the dense mask, the lse merge against one softmax, attention sinks folded in as one more partial."""

import torch

from seqpar.attention.blocks import fold_sinks, merge_partials, plan_block, sinks_grad
from seqpar.attention.layout import layout_indices, layout_seq_lens
from seqpar.attention.reference import reference_attention
from seqpar.attention.spec import AttnSpec, position_mask


def test_plan_block_matches_the_dense_mask():
    g = torch.Generator().manual_seed(0)
    specs = [AttnSpec(causal=True), AttnSpec(causal=True, window=5), AttnSpec(window=4), AttnSpec(),
             AttnSpec(chunk=7), AttnSpec(causal=True, chunk=5), AttnSpec(causal=True, window=4, chunk=6),
             AttnSpec(window=3, chunk=8), AttnSpec(chunk=1)]
    for _ in range(200):
        perm = torch.randperm(40, generator=g)
        nq, nk = (int(x) for x in torch.randint(0, 20, (2,), generator=g))
        q_pos, k_pos = perm[:nq], perm[20:20 + nk]
        for spec in specs:
            plan = plan_block(spec, q_pos, k_pos)
            allowed = position_mask(spec, q_pos, k_pos)
            if allowed is None:
                allowed = torch.ones(nq, nk, dtype=torch.bool)
            if not bool(allowed.any()):
                assert plan is None
                continue
            assert plan.visible == int(allowed.sum())
            rows, cols = allowed.any(1).nonzero().flatten(), allowed.any(0).nonzero().flatten()
            assert plan.rows == (int(rows[0]), int(rows[-1] - rows[0] + 1))
            assert plan.cols == (int(cols[0]), int(cols[-1] - cols[0] + 1))


def test_plan_block_halves_zigzag_off_diagonal_blocks():
    pos = layout_indices(64, 4, "zigzag")  # 8 chunks of 8
    spec = AttnSpec(causal=True)
    assert plan_block(spec, pos[2], pos[2]).rows == (0, 16)
    assert plan_block(spec, pos[2], pos[0]).cols == (0, 8)  # earlier rank: only its early chunk is seen
    assert plan_block(spec, pos[2], pos[0]).rows == (0, 16)
    assert plan_block(spec, pos[0], pos[2]).rows == (8, 8)  # later rank: only our late chunk sees it
    assert plan_block(spec, pos[0], pos[2]).visible == 8 * 16
    assert plan_block(spec, layout_indices(64, 4)[0], layout_indices(64, 4)[1]) is None


def test_merge_partials_equals_one_softmax():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 9, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    keep = torch.rand(2, 9, generator=g) > 0.5
    keep[0] = False  # a row that sees nothing at all
    full, full_lse = reference_attention(q, k, v, key_padding_mask=keep)
    out = torch.zeros(2, 3, 9, 4, dtype=torch.float64)
    lse = torch.full((2, 3, 9), float("-inf"), dtype=torch.float64)
    for lo, hi in ((0, 4), (4, 5), (5, 9)):
        o_b, l_b = reference_attention(q, k[:, lo:hi], v[:, lo:hi], key_padding_mask=keep[:, lo:hi])
        out, lse = merge_partials(out, lse, o_b.transpose(1, 2), l_b)
    assert torch.allclose(out.transpose(1, 2), full, atol=1e-14, rtol=0)
    assert torch.equal(torch.isinf(lse), torch.isinf(full_lse))
    assert torch.allclose(lse[~torch.isinf(lse)], full_lse[~torch.isinf(full_lse)], atol=1e-14, rtol=0)
    assert not torch.isnan(out).any()


def test_plan_block_chunk_skips_blocks_of_other_chunks():
    spec = AttnSpec(chunk=8)  # not causal: the whole chunk, both ways
    assert plan_block(spec, torch.arange(0, 8), torch.arange(8, 16)) is None
    plan = plan_block(spec, torch.arange(4, 12), torch.arange(0, 16))  # queries straddle two chunks
    assert plan.rows == (0, 8) and plan.cols == (0, 16) and plan.visible == 4 * 8 + 4 * 8
    plan = plan_block(AttnSpec(causal=True, chunk=8), torch.arange(6, 10), torch.arange(0, 12))
    assert plan.cols == (0, 10) and plan.visible == 7 + 8 + 1 + 2
    # O(S log S): a long sequence plans without building a dense mask
    pos = torch.arange(1 << 20)
    assert plan_block(AttnSpec(causal=True, chunk=4096), pos, pos).visible == 256 * 4096 * 4097 // 2


def test_fold_sinks_equals_the_reference_with_sinks():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 9, 3, d, generator=g, dtype=torch.float64) for d in (4, 4, 6))
    sinks = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(2, 9, generator=g) > 0.5
    keep[0] = False  # a row that sees no key: only the sink
    out, lse = reference_attention(q, k, v, key_padding_mask=keep)
    folded, folded_lse = fold_sinks(out.transpose(1, 2), lse, sinks)
    want, want_lse = reference_attention(q, k, v, key_padding_mask=keep, sinks=sinks)
    assert torch.allclose(folded.transpose(1, 2), want, atol=1e-14, rtol=0)
    assert torch.allclose(folded_lse, want_lse, atol=1e-14, rtol=0)
    assert (folded[0] == 0).all() and torch.equal(folded_lse[0], sinks.detach()[:, None].expand(3, 9))
    dout = torch.randn_like(want)
    (want_grad,) = torch.autograd.grad(want, sinks, dout)
    got = sinks_grad(dout.transpose(1, 2), want.detach().transpose(1, 2), want_lse, sinks.detach())
    assert torch.allclose(got, want_grad, atol=1e-14, rtol=0)


def test_layout_seq_lens_feed_the_ring_shard():
    assert layout_seq_lens(37, 4, "zigzag") == (9, 9, 9, 10)
