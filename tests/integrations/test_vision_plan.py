"""The pure parts of images under SP (seqpar.integrations.vlm.routing): units of vision work (images, video
frames), their balanced contiguous assignment to ranks, and the routing plan -- checked by running
every rank's plan on the whole batch at once (a simulated exchange) against the model's own rule:
feature row j of a modality fills the j-th placeholder of the batch, row-major, on the rank whose
shard holds it, in that rank's row-major order."""

import pytest
import torch

from seqpar.attention.layout import layout_indices
from seqpar.integrations.vlm.routing import MODALITIES, assign, merge_inputs, route_plan, units


def _grid_batch():
    grid = torch.tensor([[1, 2, 2], [1, 2, 4]])
    vgrid = torch.tensor([[3, 2, 2]])
    return {"pixel_values": torch.arange(12 * 5, dtype=torch.float64).view(12, 5), "image_grid_thw": grid,
            "pixel_values_videos": -torch.arange(12 * 5, dtype=torch.float64).view(12, 5), "video_grid_thw": vgrid}


def test_units_cut_images_by_grid_and_videos_by_frame():
    t = _grid_batch()
    whole = units(t, frames_apart=False)
    assert [u.modality for u in whole] == ["image", "image", "video"]
    assert [u.inputs["pixel_values" if u.modality == "image" else "pixel_values_videos"].shape[0] for u in whole] \
        == [4, 8, 12]
    frames = units(t, frames_apart=True)
    assert [u.modality for u in frames] == ["image", "image", "video", "video", "video"]
    assert all(u.inputs["video_grid_thw"].tolist() == [[1, 2, 2]] for u in frames[2:])
    # the frames, put back together, are the video's rows in order
    merged = merge_inputs(frames[2:])["video"]
    assert torch.equal(merged["pixel_values_videos"], t["pixel_values_videos"])
    assert merged["video_grid_thw"].tolist() == [[1, 2, 2]] * 3
    assert [u.cost for u in frames] == [20, 40, 20, 20, 20]


def test_units_of_stacked_images_carry_their_sizes():
    t = {"pixel_values": torch.randn(3, 2, 3, 4, 4), "image_sizes": torch.tensor([[4, 4], [8, 4], [4, 8]])}
    us = units(t, frames_apart=True)
    assert len(us) == 3 and all(u.inputs["pixel_values"].shape == (1, 2, 3, 4, 4) for u in us)
    assert [u.inputs["image_sizes"].tolist() for u in us] == [[[4, 4]], [[8, 4]], [[4, 8]]]
    back = merge_inputs(us[1:])["image"]
    assert torch.equal(back["pixel_values"], t["pixel_values"][1:]) and back["image_sizes"].shape == (2, 2)


@pytest.mark.parametrize("costs, p, want", [
    ([1] * 8, 2, [4, 4]), ([1] * 8, 4, [2, 2, 2, 2]), ([1] * 3, 2, [1, 2]), ([5], 3, [0, 1, 0]),
    ([4, 1, 1, 1, 1], 2, [1, 4]), ([], 2, [0, 0]),
])
def test_assign_is_contiguous_and_balanced(costs, p, want):
    runs = assign(costs, p)
    assert [len(r) for r in runs] == want
    flat = [i for r in runs for i in r]
    assert flat == list(range(len(costs)))  # contiguous, in order, every unit once
    if costs:
        mean = sum(costs) / p
        assert max(sum(costs[i] for i in r) for r in runs) <= mean + max(costs)


def _simulate(masks, rows, pieces):
    """Every rank's plan applied to the whole batch: what each rank receives, in its order."""
    p = len(pieces)
    plans = [route_plan(masks, rows, pieces, r) for r in range(p)]
    # global feature rows: (modality, j) -> a distinct number; rank r's local rows: images then videos
    feats = {}
    local = []
    for r in range(p):
        mine = []
        for m in MODALITIES:
            start = sum(rows[q].get(m, 0) for q in range(r))
            mine += [(m, start + i) for i in range(rows[r].get(m, 0))]
        local.append(mine)
    for r in range(p):
        got = []
        for s in range(p):
            sent = [local[s][i] for i in plans[s].send_index[r].tolist()]
            assert len(sent) == plans[r].recv_counts[s]
            got += sent
        if plans[r].order is not None:
            got = [got[i] for i in plans[r].order.tolist()]
        feats[r] = got
    return feats, plans


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_route_plan_puts_every_feature_row_at_its_placeholder(p, layout):
    g = torch.Generator().manual_seed(p)
    b, s = 3, 23
    kind = torch.randint(0, 3, (b, s), generator=g)  # 0 text, 1 image, 2 video placeholder
    masks = {"image": kind == 1, "video": kind == 2}
    n = {m: int(masks[m].sum()) for m in MODALITIES}
    # ranks own consecutive ranges of rows: a random split of each modality's rows
    rows = []
    for m in MODALITIES:
        cuts = sorted(torch.randint(0, n[m] + 1, (p - 1,), generator=g).tolist())
        sizes = [b_ - a for a, b_ in zip([0, *cuts], [*cuts, n[m]], strict=True)]
        for r in range(p):
            if len(rows) <= r:
                rows.append({})
            rows[r][m] = sizes[r]
    pieces = layout_indices(s, p, layout)
    feats, plans = _simulate(masks, rows, pieces)
    for r in range(p):
        want = []
        for m in MODALITIES:
            order = masks[m].flatten().cumsum(0).view(b, s) - 1  # j of each placeholder, row-major
            local_mask, local_j = masks[m][:, pieces[r]], order[:, pieces[r]]
            want += [(m, int(j)) for j in local_j[local_mask].tolist()]  # the rank's row-major order
        assert feats[r] == want
        assert plans[r].counts == {m: int(masks[m][:, pieces[r]].sum()) for m in MODALITIES}


def test_route_plan_of_an_image_only_batch_needs_no_reordering():
    masks = {"image": torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)}
    pieces = layout_indices(8, 2, "contiguous")
    rows = [{"image": 5}, {"image": 0}]  # rank 0 encoded everything
    feats, plans = _simulate(masks, rows, pieces)
    assert feats[0] == [("image", j) for j in range(3)] and feats[1] == [("image", j) for j in (3, 4)]
    assert plans[1].recv_counts == [2, 0] and plans[0].send_index[1].tolist() == [3, 4]
    assert all(pl.order is None for pl in plans)


def test_units_of_images_batched_per_row_are_the_real_images_row_major():
    # Idefics / SmolVLM: [B, images, C, H, W]; row 1 has one image and an all-zero one padding it
    pixels = torch.randn(2, 2, 3, 4, 4, dtype=torch.float64)
    pixels[1, 1] = 0
    mask = torch.ones(2, 2, 4, 4, dtype=torch.bool)
    mask[1, 1] = False
    us = units({"pixel_values": pixels, "pixel_attention_mask": mask}, frames_apart=False, per_row=True)
    assert [u.modality for u in us] == ["image"] * 3
    for u, (b, i) in zip(us, [(0, 0), (0, 1), (1, 0)], strict=True):
        assert u.inputs["pixel_values"].shape == (1, 1, 3, 4, 4) and torch.equal(u.inputs["pixel_values"][0, 0],
                                                                                  pixels[b, i])
        assert u.inputs["pixel_attention_mask"].shape == (1, 1, 4, 4) and u.cost == 3 * 4 * 4
    # a rank's share is a batch of rows of one image each: the model keeps them in this order
    assert merge_inputs(us[1:])["image"]["pixel_values"].shape == (2, 1, 3, 4, 4)


def test_documents_of_packed_rows_leave_padding_out():
    from seqpar.integrations.vlm.positions import documents

    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 1, 1, 1]])
    keep = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    docs = [(b, idx.tolist()) for b, idx in documents(segments, keep)]
    assert docs == [(0, [0, 1, 2]), (0, [3, 4]), (1, [0, 1, 2, 3]), (1, [4, 5, 6])]
    assert [(b, idx.tolist()) for b, idx in documents(segments[:1], None)] == [(0, [0, 1, 2]), (0, [3, 4]),
                                                                             (0, [5, 6])]
