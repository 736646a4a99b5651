"""Layouts are pure index arithmetic: permutations, inverses, chunk ownership, uneven lengths, and
doc-zigzag's cuts and its causal balance on packed and padded batches."""

import math

import pytest
import torch

from seqpar.attention.layout import (
    document_cuts,
    inverse_permutation,
    layout_indices,
    layout_permutation,
    layout_seq_lens,
    min_seq_len,
)

SHAPES = [(s, sp, u) for s in (0, 1, 2, 3, 7, 16, 37, 129) for sp in (1, 2, 3, 4, 6, 8)
          for u in range(1, sp + 1) if sp % u == 0]


LAYOUTS = ("contiguous", "zigzag", "doc-zigzag")


def _random_cuts(s, g):
    """doc-zigzag cuts of a random batch: up to 6 cut points (no cuts at all, sometimes)."""
    n = int(torch.randint(0, 7, (), generator=g))
    return tuple(sorted(set(torch.randint(1, s, (n,), generator=g).tolist()))) if s > 1 else ()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_token_held_exactly_once(layout):
    g = torch.Generator().manual_seed(0)
    for s, sp, u in SHAPES:
        cuts = _random_cuts(s, g) if layout == "doc-zigzag" else None
        parts = layout_indices(s, sp, layout, ulysses=u, cuts=cuts)
        assert len(parts) == sp
        perm = torch.cat(parts)
        assert torch.equal(perm.sort().values, torch.arange(s)), (s, sp, u)
        assert torch.equal(perm, layout_permutation(s, sp, layout, ulysses=u, cuts=cuts))
        assert layout_seq_lens(s, sp, layout, ulysses=u, cuts=cuts) == tuple(len(p) for p in parts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inverse_restores_the_original_order(layout):
    x = torch.randn(2, 37, 3)
    for sp in (1, 2, 3, 4):
        perm = layout_permutation(37, sp, layout, cuts=(5, 6, 20) if layout == "doc-zigzag" else None)
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


def test_doc_zigzag_matches_the_diagram():
    # one row with documents [0, 4) and [4, 16): each document is zigzagged on its own
    seg = torch.tensor([[0] * 4 + [1] * 12])
    cuts = document_cuts(seg)
    assert cuts == (4,)
    got = [p.tolist() for p in layout_indices(16, 2, "doc-zigzag", cuts=cuts)]
    assert got == [[0, 3, 4, 5, 6, 13, 14, 15], [1, 2, 7, 8, 9, 10, 11, 12]]
    work = [sum(t + 1 - (0 if t < 4 else 4) for t in part) for part in got]  # keys each query sees
    assert work == [44, 44]
    zig = [sum(t + 1 - (0 if t < 4 else 4) for t in part.tolist()) for part in layout_indices(16, 2, "zigzag")]
    assert zig == [52, 36]
    # ulysses: a ring rank's tokens (in order) split contiguously over its ulysses ranks
    got = [p.tolist() for p in layout_indices(16, 4, "doc-zigzag", ulysses=2, cuts=cuts)]
    assert got == [[0, 3, 4, 5], [6, 13, 14, 15], [1, 2, 7, 8], [9, 10, 11, 12]]


def test_document_cuts_are_the_union_over_rows_of_starts_and_padding_edges():
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    keep = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert document_cuts(seg) == (3, 5, 7)
    assert document_cuts(None, keep) == (2, 6)
    assert document_cuts(seg, keep) == (2, 3, 5, 6, 7)
    assert document_cuts(None, None) == ()
    assert document_cuts(torch.zeros(2, 0, dtype=torch.long)) == ()
    with pytest.raises(ValueError, match="key_keep must be \\[batch, seq_len\\]"):
        document_cuts(seg, keep[:, :5])
    with pytest.raises(ValueError, match="segments must be"):
        document_cuts(seg[0])


def test_doc_zigzag_pieces_are_zigzagged_and_ring_lengths_differ_by_one():
    g = torch.Generator().manual_seed(1)
    for s, sp, u in SHAPES:
        ring = sp // u
        for cuts in (_random_cuts(s, g), tuple(range(1, s))):  # a few pieces; every token its own piece
            parts = layout_indices(s, sp, "doc-zigzag", ulysses=u, cuts=cuts)
            owner = torch.empty(s, dtype=torch.long)
            held = []
            for i in range(ring):
                mine = torch.cat(parts[i * u:(i + 1) * u])
                assert torch.equal(mine, mine.sort().values)  # in token order, split contiguously
                sizes = [len(p) for p in parts[i * u:(i + 1) * u]]
                assert max(sizes) - min(sizes) <= 1
                owner[mine] = i
                held.append(len(mine))
            assert max(held) - min(held) <= 1, (s, sp, u, cuts, held)
            for a, b in zip((0, *cuts), (*cuts, s), strict=True):
                # inside a piece: ring ranks 0 .. R-1 (head parts), then R-1 .. 0 (tail parts), each
                # part floor or ceil(n / 2R) tokens (the middle rank's two parts touch: its total only)
                if a == b:  # an empty sequence has one empty piece
                    continue
                seq = owner[a:b].tolist()
                k = next((j for j in range(1, len(seq)) if seq[j] < seq[j - 1]), len(seq))
                head, tail = seq[:k], seq[k:]
                assert tail == sorted(tail, reverse=True), (s, sp, u, (a, b), seq)
                lo, hi = (b - a) // (2 * ring), -(-(b - a) // (2 * ring))
                for r in range(ring):
                    if r != max(seq):
                        assert lo <= head.count(r) <= hi and lo <= tail.count(r) <= hi, (s, sp, u, (a, b), seq)
                    assert 2 * lo <= seq.count(r) <= 2 * hi


def test_doc_zigzag_without_cuts_is_zigzag_when_the_chunks_are_even():
    for s, sp, u in SHAPES:
        if s % (2 * sp // u) == 0:
            assert layout_permutation(s, sp, "doc-zigzag", u, cuts=()).tolist() == \
                layout_permutation(s, sp, "zigzag", u).tolist()


def _packed_batch(rows, s, g, pad=False):
    """``(segments, key_keep)`` [rows, s]: documents log-uniform in 64..s; with ``pad``, each row
    right-padded after a random share of its tokens (a padded row holds one document)."""
    seg = torch.zeros(rows, s, dtype=torch.long)
    keep = torch.ones(rows, s, dtype=torch.bool)
    for b in range(rows):
        if pad:
            keep[b, int(s * (0.3 + 0.7 * float(torch.rand((), generator=g)))):] = False
            continue
        n = 0
        while n < s:
            n += int(math.exp(math.log(64) + float(torch.rand((), generator=g)) * (math.log(s) - math.log(64))))
            seg[b, n:] += 1
    return seg, keep


def _causal_work(seg, keep):
    """``[S]`` visible pairs of the queries at each position, summed over rows: the kept keys at or
    before the query in its document."""
    kept = keep.long().cumsum(1)  # [B, S]
    first = torch.ones_like(seg, dtype=torch.bool)
    first[:, 1:] = seg[:, 1:] != seg[:, :-1]
    before = torch.where(first, kept - keep.long(), torch.zeros_like(kept))  # kept tokens before the document
    start = torch.cummax(before, dim=1).values  # documents start in order, so the running max is the latest
    return (kept - start).sum(0)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_doc_zigzag_balances_packed_and_padded_batches(p):
    g = torch.Generator().manual_seed(p)
    for rows, s, pad, u in ((1, 4096, False, 1), (1, 4099, False, 1), (3, 4099, False, 1), (2, 3001, True, 1),
                            (2, 4096, False, 2)):
        seg, keep = _packed_batch(rows, s, g, pad)
        work = _causal_work(seg, keep)
        ratios = {}
        for layout in LAYOUTS:
            cuts = document_cuts(seg, keep) if layout == "doc-zigzag" else None
            parts = layout_indices(s, p * u, layout, ulysses=u, cuts=cuts)
            ring_work = [float(work[torch.cat(parts[i * u:(i + 1) * u])].sum()) for i in range(p)]
            ratios[layout] = max(ring_work) / (sum(ring_work) / p)
        assert ratios["doc-zigzag"] <= 1.01, (rows, s, pad, u, ratios)


def test_min_seq_len_is_the_shortest_sequence_with_no_empty_shard():
    g = torch.Generator().manual_seed(2)
    for sp in (1, 2, 3, 4, 6, 8):
        for u in (d for d in range(1, sp + 1) if sp % d == 0):
            for layout in LAYOUTS:
                n = min_seq_len(sp, layout, u)
                for s, cut_sets in ((n, 3), (n + 1, 3)):
                    for _ in range(cut_sets):
                        cuts = _random_cuts(s, g) if layout == "doc-zigzag" else None
                        assert min(layout_seq_lens(s, sp, layout, u, cuts)) > 0, (sp, u, layout, s)
                if layout != "doc-zigzag":
                    assert min(layout_seq_lens(n - 1, sp, layout, u)) == 0, (sp, u, layout)
    assert min_seq_len(8, "zigzag", 4) == 8 and min_seq_len(8, "zigzag", 1) == 8 and min_seq_len(4, "contiguous") == 4


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
    with pytest.raises(ValueError, match="layout='doc-zigzag' follows the batch's documents: pass cuts="):
        layout_indices(8, 2, "doc-zigzag")
    with pytest.raises(ValueError, match="cuts apply only to layout='doc-zigzag', not 'zigzag'"):
        layout_indices(8, 2, "zigzag", cuts=(3,))
    for cuts in ((0, 3), (3, 3), (5, 2), (8,)):
        with pytest.raises(ValueError, match=r"cuts must be increasing positions inside \(0, 8\)"):
            layout_indices(8, 2, "doc-zigzag", cuts=cuts)


def test_chunked_documents_count_chunks_from_each_document_start():
    """Chunks of 2 on a packed row (documents 0..4 and 5..7), in token order and through a zigzag
    layout: the finer segments group exactly {0,1} {2,3} {4} {5,6} {7}."""
    from seqpar.attention.shard import SeqShard, chunked_documents

    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    want = [[0, 1], [2, 3], [4], [5, 6], [7]]
    for perm in (None, layout_permutation(8, 2, "zigzag")):
        layout_seg = seg if perm is None else seg[:, perm]
        finer = chunked_documents(SeqShard((4, 4), perm, None, layout_seg), 2).segments[0]
        tokens = torch.arange(8) if perm is None else perm  # original index of each layout position
        groups = {}
        for t, g in zip(tokens.tolist(), finer.tolist(), strict=True):
            groups.setdefault(g, []).append(t)
        assert sorted(sorted(v) for v in groups.values()) == want
