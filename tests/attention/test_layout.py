"""Layouts are pure index arithmetic: permutations, inverses, chunk ownership, uneven lengths."""

import pytest
import torch

from seqpar.attention.layout import inverse_permutation, layout_indices, layout_permutation, layout_seq_lens

SHAPES = [(s, sp, u) for s in (0, 1, 2, 3, 7, 16, 37, 129) for sp in (1, 2, 3, 4, 6, 8)
          for u in range(1, sp + 1) if sp % u == 0]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_every_token_held_exactly_once(layout):
    for s, sp, u in SHAPES:
        parts = layout_indices(s, sp, layout, ulysses=u)
        assert len(parts) == sp
        perm = torch.cat(parts)
        assert torch.equal(perm.sort().values, torch.arange(s)), (s, sp, u)
        assert torch.equal(perm, layout_permutation(s, sp, layout, ulysses=u))
        assert layout_seq_lens(s, sp, layout, ulysses=u) == tuple(len(p) for p in parts)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_inverse_restores_the_original_order(layout):
    x = torch.randn(2, 37, 3)
    for sp in (1, 2, 3, 4):
        perm = layout_permutation(37, sp, layout)
        inv = inverse_permutation(perm)
        assert torch.equal(x[:, perm][:, inv], x)
        assert torch.equal(perm[inv], torch.arange(37))
        assert torch.equal(inv[perm], torch.arange(37))


def test_contiguous_is_tensor_split():
    for s, sp, u in SHAPES:
        parts = layout_indices(s, sp, "contiguous", ulysses=u)
        for got, want in zip(parts, torch.tensor_split(torch.arange(s), sp), strict=True):
            assert torch.equal(got, want)


def test_zigzag_chunk_ownership_matches_the_diagram():
    got = [p.tolist() for p in layout_indices(16, 4, "zigzag")]
    assert got == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    got = [p.tolist() for p in layout_indices(16, 4, "zigzag", ulysses=2)]
    assert got == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    # ulysses == sp: one ring rank holds everything, split contiguously
    got = [p.tolist() for p in layout_indices(8, 2, "zigzag", ulysses=2)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_zigzag_ring_rank_holds_chunks_i_and_mirror():
    for s, sp, u in SHAPES:
        ring = sp // u
        chunks = torch.tensor_split(torch.arange(s), 2 * ring)
        parts = layout_indices(s, sp, "zigzag", ulysses=u)
        for i in range(ring):
            held = torch.cat(parts[i * u:(i + 1) * u])  # the ulysses ranks of ring rank i, in order
            assert torch.equal(held, torch.cat([chunks[i], chunks[2 * ring - 1 - i]])), (s, sp, u, i)
            sizes = [len(p) for p in parts[i * u:(i + 1) * u]]
            assert max(sizes) - min(sizes) <= 1  # contiguous tensor_split inside the ring rank


def test_uneven_and_short_sequences():
    assert [p.tolist() for p in layout_indices(3, 4, "zigzag")] == [[0], [1], [2], []]
    assert [p.tolist() for p in layout_indices(7, 2, "zigzag")] == [[0, 1, 6], [2, 3, 4, 5]]
    assert layout_seq_lens(0, 3, "zigzag") == (0, 0, 0)
    assert layout_seq_lens(37, 4, "zigzag") == (9, 9, 9, 10)


def test_zigzag_balances_causal_work():
    s, sp = 4096, 4
    for layout, lo, hi in (("zigzag", 1.0, 1.01), ("contiguous", 1.7, 1.8)):
        # causal work of a query at position t is t + 1 visible keys
        work = [float((p + 1).sum()) for p in layout_indices(s, sp, layout)]
        ratio = max(work) / (sum(work) / sp)
        assert lo <= ratio <= hi, (layout, ratio)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown layout 'zig'"):
        layout_indices(8, 2, "zig")
    with pytest.raises(ValueError, match="ulysses=3 must be a positive divisor of sp=4"):
        layout_indices(8, 4, "zigzag", ulysses=3)
    with pytest.raises(ValueError, match="sp"):
        layout_permutation(8, 0)
    with pytest.raises(ValueError, match="seq_len"):
        layout_permutation(-1, 2)
    with pytest.raises(ValueError, match="repeated"):
        inverse_permutation(torch.tensor([0, 0, 2]))
    with pytest.raises(ValueError, match="outside"):
        inverse_permutation(torch.tensor([0, 3, 1]))
    with pytest.raises(ValueError, match="1-D"):
        inverse_permutation(torch.zeros(2, 2, dtype=torch.long))
