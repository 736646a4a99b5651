"""shard_batch and its pure helpers: target shifting rules, packed-document segments, the problems a
batch can have, and (4 gloo processes) what each rank receives: slices that put back together give
the full shifted batch, uneven, zigzag and doc-zigzag layouts (on a ulysses x ring mesh too), and
target counts summed over dp."""

import warnings

import pytest
import torch

import seqpar
from seqpar.attention.layout import document_cuts, layout_indices
from seqpar.attention.shard import SeqShard
from seqpar.batch.local_batch import BATCH_KWARG, LocalBatch
from seqpar.batch.targets import (
    IGNORE_INDEX,
    prepare_batch,
    segments_from_positions,
    shift_targets,
    target_count,
    targets_after_padding,
)
from seqpar.batch.validate import checksum, local_problem
from seqpar.comm.launch import run_distributed
from seqpar.errors import TargetsLeftOut

X = IGNORE_INDEX


def test_segments_restart_where_positions_do_not_grow_by_one():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert segments_from_positions(pos).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8]
    # an offset start (a continued document) is one document
    assert segments_from_positions(torch.tensor([[5, 6, 7]])).tolist() == [[0, 0, 0]]


def test_shift_targets_plain_last_position_has_no_target():
    labels = torch.tensor([[10, 11, 12, 13]])
    t, w = shift_targets(labels)
    assert t.tolist() == [[11, 12, 13, X]] and w is None


def test_shift_targets_ignores_padding_on_either_side():
    labels = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    keep = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.bool)  # right / left padding
    t, _ = shift_targets(labels, key_keep=keep)
    assert t.tolist() == [[11, 12, X, X, X], [X, X, 23, 24, X]]


def test_shift_targets_never_crosses_documents():
    labels = torch.tensor([[10, 11, 12, 13, 14, 15]])
    seg = segments_from_positions(torch.tensor([[0, 1, 2, 0, 1, 2]]))
    t, _ = shift_targets(labels, segments=seg)
    assert t.tolist() == [[11, 12, X, 14, 15, X]]


def test_shift_targets_keeps_ignore_index_and_shifts_weights():
    labels = torch.tensor([[10, X, 12, 13]])
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    t, sw = shift_targets(labels, weights=w)
    assert t.tolist() == [[X, 12, 13, X]]
    assert sw.tolist() == [[0.0, 3.0, 4.0, 0.0]]  # weights follow their label; 0 where no target


def test_prepare_batch_defaults_and_counts():
    ids = torch.arange(12).view(2, 6)
    prep = prepare_batch({"input_ids": ids, "labels": ids})
    assert prep.position_ids.tolist() == [list(range(6))] * 2  # arange, as transformers does
    assert prep.key_keep is None and prep.segments is None  # nothing to mask
    assert target_count(prep) == 10
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    prep = prepare_batch({"input_ids": ids, "labels": ids, "attention_mask": mask,
                          "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])})  # [1, S] broadcasts
    assert prep.key_keep[1].tolist() == [True] * 4 + [False] * 2
    assert prep.segments.tolist() == [[0, 0, 0, 1, 1, 1]] * 2
    assert target_count(prep) == 4 + 2  # row 0: 2 + 2 (a boundary at 3); row 1: 2 (3 -> 4 is padding)
    w = torch.full((2, 6), 0.5, dtype=torch.float64)
    assert target_count(prepare_batch({"input_ids": ids, "labels": ids, "loss_weights": w})) == 5.0


def _padded_both_ways(seed: int, left: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Rows of 9 tokens: row r left-padded by ``left[r]`` (negative: right-padded), labels -100 on
    padding, row 2's first real token without a label; transformers' position ids."""
    g = torch.Generator().manual_seed(seed)
    rows = len(left)
    ids = torch.randint(1, 50, (rows, 9), generator=g)
    mask = torch.ones(rows, 9, dtype=torch.long)
    for r, n in enumerate(left):
        mask[r, :n] = 0 if n > 0 else 1
        mask[r, 9 + n:] = 0 if n < 0 else 1
    pos = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
    labels = ids.masked_fill(mask == 0, X)
    if rows > 2:
        labels[2, int(mask[2].argmax())] = X
    return {"input_ids": ids.masked_fill(mask == 0, 0), "labels": labels, "attention_mask": mask,
            "position_ids": pos}


def _left_out(batch: dict[str, torch.Tensor]) -> int:
    """transformers' count (every shifted label that is not -100) minus seqpar's (the targets rule)."""
    return int((batch["labels"][:, 1:] != X).sum()) - int(target_count(prepare_batch(batch)))


def test_targets_after_padding_are_what_transformers_counts_and_seqpar_does_not():
    batch = _padded_both_ways(0, (3, -2, 1, 0, 5))
    prep = prepare_batch(batch)
    assert _left_out(batch) == 2  # rows 0 and 4: their first real token (row 2: no label, row 1: right padding)
    assert targets_after_padding(batch["labels"], prep.key_keep) == _left_out(batch)
    right = _padded_both_ways(0, (-3, -2, 0))
    assert targets_after_padding(right["labels"], prepare_batch(right).key_keep) == _left_out(right) == 0
    assert targets_after_padding(batch["labels"], None) == 0


Z = torch.zeros(2, 4, dtype=torch.long)


@pytest.mark.parametrize("batch, problem", [
    ({"input_ids": Z, BATCH_KWARG: None}, "already sharded"),
    ({"labels": Z}, "neither input_ids"),
    ({"input_ids": torch.zeros(8, dtype=torch.long)}, "input_ids must be"),
    ({"input_ids": Z, "pixel_valuez": torch.zeros(1)}, "does not know"),
    ({"input_ids": Z, "image_grid_thw": torch.tensor([[1, 2, 2]])}, "without pixel_values"),
    ({"input_ids": Z, "token_type_ids": Z[:, :3]}, "token_type_ids must be an integer tensor [batch, seq_len]"),
    ({"input_ids": Z, "token_type_ids": Z}, None),  # kept whole: the model's family makes spans of them
    ({"input_ids": Z, "labels": torch.zeros(2, 5, dtype=torch.long)}, "labels must have"),
    ({"input_ids": Z, "attention_mask": torch.ones(2, 1, 4, 4)}, "attention_mask must be"),
    ({"input_ids": Z, "position_ids": torch.zeros(3, 4, dtype=torch.long)}, "position_ids must be"),
    ({"input_ids": Z, "loss_weights": torch.ones(2, 4)}, "loss_weights must"),
    ({"input_ids": Z, "labels": Z,
      "attention_mask": torch.ones(2, 4), "position_ids": torch.zeros(1, 4, dtype=torch.long),
      "loss_weights": torch.ones(2, 4), "use_cache": False}, None),
])
def test_local_problems(batch, problem):
    found = local_problem(batch)[0]
    assert found == problem if problem is None else problem in found


CU = torch.tensor([0, 3, 4, 8], dtype=torch.int32)  # documents 0..2 | 3 | 4..7 of a [2, 4] batch


@pytest.mark.parametrize("extra, problem", [
    ({"cu_seq_lens_q": CU, "cu_seq_lens_k": CU, "max_length_q": 4, "max_length_k": 4}, None),
    ({"cu_seq_lens_q": CU}, "both be given and equal"),
    ({"cu_seq_lens_q": CU, "cu_seq_lens_k": torch.tensor([0, 4, 8])}, "both be given and equal"),
    ({"cu_seq_lens_q": torch.tensor([0, 3, 3, 8]), "cu_seq_lens_k": torch.tensor([0, 3, 3, 8])}, "grow strictly"),
    ({"cu_seq_lens_q": torch.tensor([0, 4, 9]), "cu_seq_lens_k": torch.tensor([0, 4, 9])}, "documents longer"),
    ({"cu_seq_lens_q": torch.tensor([0, 3, 8]), "cu_seq_lens_k": torch.tensor([0, 3, 8])}, "crosses a row"),
    ({"cu_seq_lens_q": CU, "cu_seq_lens_k": CU, "position_ids": torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])},
     "contradicts position_ids"),
    ({"cu_seq_lens_q": CU, "cu_seq_lens_k": CU, "position_ids": torch.tensor([[0, 1, 2, 0], [0, 1, 2, 3]])}, None),
])
def test_cu_seqlens_are_checked_against_the_rows_and_positions(extra, problem):
    found = local_problem({"input_ids": Z, **extra})[0]
    assert found == problem if problem is None else problem in found


def test_cu_seqlens_alone_give_the_documents():
    prep = prepare_batch({"input_ids": Z, "labels": Z, "cu_seq_lens_q": CU, "cu_seq_lens_k": CU})
    assert prep.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert prep.segments.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0]]


def test_checksum_tells_batches_apart():
    a = torch.arange(20).view(2, 10)
    assert checksum(a) == checksum(a.clone())
    assert checksum(a) != checksum(a.flip(1))  # same tokens, other order
    assert checksum(None) == -1.0


def test_local_batch_grad_scale_is_made_for_the_average_over_the_ranks():
    shard = SeqShard((3, 3))
    mean = LocalBatch(shard, sp_rank=0, sp_size=2, dp_size=4, denominator=10, num_items_in_batch=None,
                      loss_weights=None)
    assert mean.grad_scale == 2 / 10  # per-dp-rank mean: the sp average combines the shares, dp averages means
    glob = LocalBatch(shard, sp_rank=0, sp_size=2, dp_size=4, denominator=50, num_items_in_batch=50,
                      loss_weights=None)
    assert glob.grad_scale == 8 / 50  # one global mean: the average over all 2 x 4 ranks combines the shares
    empty = LocalBatch(shard, sp_rank=0, sp_size=2, dp_size=1, denominator=0, num_items_in_batch=None,
                       loss_weights=None)
    assert empty.grad_scale == 2.0  # no target: loss 0, not NaN


# --------------------------------------------------------------------------------------------
# 4 processes: what each rank gets
# --------------------------------------------------------------------------------------------

def _full_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2, 11), generator=g)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 8:] = 0
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6], list(range(11))])
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask, "position_ids": pos,
            "loss_weights": torch.rand(2, 11, generator=g, dtype=torch.float64)}


LAYOUTS = ("contiguous", "zigzag", "doc-zigzag", "doc-zigzag 2x2")


def _pieces(layout):
    """Each rank's token indices in the full batch under ``layout`` ("... 2x2": ulysses=2 x ring=2)."""
    prep = prepare_batch(_full_batch())
    name, _, grid = layout.partition(" ")
    cuts = document_cuts(prep.segments, prep.key_keep) if name == "doc-zigzag" else None
    return layout_indices(11, 4, name, 2 if grid else 1, cuts)


def _worker(rank, world):
    torch.set_num_threads(1)
    out = {}
    batch = _full_batch()
    for layout in LAYOUTS:
        name, _, grid = layout.partition(" ")
        mesh = seqpar.init_mesh(sp=4, ulysses=2, ring=2, device_type="cpu") if grid else \
            seqpar.init_mesh(sp=4, device_type="cpu")
        local = seqpar.shard_batch(batch, mesh, layout=name)
        info = local[BATCH_KWARG]
        out[layout] = {k: v for k, v in local.items() if k != BATCH_KWARG}
        out[layout]["shard"] = info.shard
        out[layout]["denominator"] = info.denominator
        out[layout]["weights"] = info.loss_weights
    moved = seqpar.shard_batch(batch, seqpar.init_mesh(sp=4, device_type="cpu"), layout="zigzag", device="meta")
    out["moved"] = {k: (str(v.device), tuple(v.shape)) for k, v in moved.items() if isinstance(v, torch.Tensor)}
    weights = moved[BATCH_KWARG].loss_weights
    out["moved"]["weights"] = (str(weights.device), tuple(weights.shape))
    try:  # 3 tokens cannot fill 4 ranks, whatever the layout
        seqpar.shard_batch({k: v[:, :3] for k, v in batch.items()}, seqpar.init_mesh(sp=4, device_type="cpu"),
                           layout="doc-zigzag")
        out["too short"] = "no error"
    except ValueError as e:
        out["too short"] = str(e)
    contradicting = dict(batch, cu_seq_lens_q=torch.tensor([0, 11, 22]), cu_seq_lens_k=torch.tensor([0, 11, 22]))
    try:  # documents of the offsets and of the position ids differ: the same error on every rank
        seqpar.shard_batch(contradicting, seqpar.init_mesh(sp=4, device_type="cpu"))
        out["cu contradiction"] = "no error"
    except ValueError as e:
        out["cu contradiction"] = str(e)
    mesh = seqpar.init_mesh(sp=2, dp=2, device_type="cpu")
    dp = mesh.get_local_rank("dp")
    mine = [_full_batch()] if dp == 0 else [_full_batch(), {"input_ids": batch["input_ids"][:, :5],
                                                           "labels": batch["labels"][:, :5]}]
    for b in mine:
        b.pop("loss_weights", None)
    out["count"] = seqpar.count_target_tokens(mine, mesh)
    out["count_labels"] = seqpar.count_target_tokens([b["labels"] for b in mine], mesh)
    local = seqpar.shard_batch(mine[0], mesh, num_items_in_batch=out["count"])
    out["dp_denominator"] = local[BATCH_KWARG].denominator
    out["dp_scale"] = local[BATCH_KWARG].grad_scale
    with warnings.catch_warnings(record=True) as told:  # left padding: said once, on rank 0
        warnings.simplefilter("always")
        for seed, left in ((1, (-2, 3, 1, 2)), (2, (4, 1, 0))):  # no left-out target first, then some
            seqpar.shard_batch(_padded_both_ways(seed, left), mesh)
    out["told"] = [(w.category.__name__, str(w.message)) for w in told if issubclass(w.category, TargetsLeftOut)]
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 4, timeout=120)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_slices_put_back_together_give_the_full_shifted_batch(ranks, layout):
    batch = _full_batch()
    prep = prepare_batch(batch)
    pieces = _pieces(layout)
    assert [len(p) for p in pieces] == [r[layout]["input_ids"].shape[1] for r in ranks]
    perm = torch.cat(pieces)
    for key, full in (("input_ids", batch["input_ids"]), ("position_ids", prep.position_ids),
                      ("labels", prep.targets), ("weights", prep.weights)):
        got = torch.cat([r[layout][key] for r in ranks], dim=1)
        assert torch.equal(got, full[:, perm]), key
    assert all(r[layout]["shift_labels"] is not None for r in ranks)
    assert all(r[layout]["use_cache"] is False for r in ranks)
    # the target of the last token of rank 0's shard is rank 1's first token: kept across the cut
    if layout == "contiguous":
        assert ranks[0][layout]["labels"][0, -1] == batch["labels"][0, 3]


@pytest.mark.distributed
def test_device_moves_the_shard_and_only_the_shard(ranks):
    """``device=``: every returned tensor (and the loss weights) on that device, each the shard's size."""
    for r in ranks:
        want = {k: tuple(v.shape) for k, v in r["zigzag"].items() if isinstance(v, torch.Tensor)}
        assert r["moved"] == {k: ("meta", shape) for k, shape in want.items()}
        assert "weights" in want and "input_ids" in want


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_metadata_is_global_and_in_layout_order(ranks, layout):
    prep = prepare_batch(_full_batch())
    perm = torch.cat(_pieces(layout))
    for r in ranks:
        shard = r[layout]["shard"]
        assert shard.seq_lens == (3, 3, 3, 2) if layout == "contiguous" else sum(shard.seq_lens) == 11
        if layout == "contiguous":
            assert shard.positions is None
        else:
            assert torch.equal(shard.positions, perm)
        assert torch.equal(shard.key_keep, prep.key_keep[:, perm])
        assert torch.equal(shard.segments, prep.segments[:, perm])
        assert r[layout]["denominator"] == pytest.approx(float(prep.weights.sum()), abs=1e-12)


@pytest.mark.distributed
def test_doc_zigzag_follows_the_batch_documents_and_padding(ranks):
    # row 0: documents [0, 4) and [4, 11); row 1: padding from 8: pieces [0, 4), [4, 8), [8, 11)
    assert document_cuts(prepare_batch(_full_batch()).segments, prepare_batch(_full_batch()).key_keep) == (4, 8)
    perm = ranks[0]["doc-zigzag"]["shard"].positions
    assert not torch.equal(perm, torch.cat(layout_indices(11, 4, "zigzag")))
    # each piece is shorter than its 2R = 8 parts: its tokens go one each to the ranks holding the
    # fewest so far, into head parts (0 1 2 3), then tail parts (3 2 1 0), then head parts again
    assert [p.tolist() for p in _pieces("doc-zigzag")] == [[0, 7, 8], [1, 6, 9], [2, 5, 10], [3, 4]]
    assert torch.equal(perm, torch.tensor([0, 7, 8, 1, 6, 9, 2, 5, 10, 3, 4]))
    assert all("use sequences of at least 4 tokens" in r["too short"] for r in ranks), ranks[0]["too short"]


@pytest.mark.distributed
def test_count_target_tokens_sums_over_dp(ranks):
    prep = prepare_batch({k: v for k, v in _full_batch().items() if k != "loss_weights"})
    # dp rank 0: one batch; dp rank 1: the same batch and a 5-token slice without mask (2 x 4 targets)
    expected = 2 * target_count(prep) + 8
    assert all(r["count"] == expected for r in ranks)
    assert all(isinstance(r["count"], int) for r in ranks)
    # bare labels know nothing of padding or documents: every shifted label counts
    assert all(r["count_labels"] == 2 * (2 * 10) + 8 for r in ranks)
    assert all(r["dp_denominator"] == expected and r["dp_scale"] == 4 / expected for r in ranks)  # dp x sp = 4


@pytest.mark.distributed
def test_targets_left_out_by_left_padding_are_said_once_on_rank_0(ranks):
    first = _left_out(_padded_both_ways(1, (-2, 3, 1, 2)))
    assert first > 0 and _left_out(_padded_both_ways(2, (4, 1, 0))) > 0  # both batches leave some out
    assert [r["told"] for r in ranks[1:]] == [[]] * 3
    assert len(ranks[0]["told"]) == 1, ranks[0]["told"]
    message = ranks[0]["told"][0][1]
    assert message.startswith(f"{first} label(s) of this batch are no position's target: the first real token")
    assert "Said once per process, on rank 0" in message


@pytest.mark.distributed
def test_contradicting_cu_seqlens_raise_on_every_rank(ranks):
    assert all("contradicts position_ids" in r["cu contradiction"] for r in ranks)
