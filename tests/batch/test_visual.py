"""The visual side of a batch (seqpar.batch.visual): which processor keys shard_batch takes, which it
refuses by mechanism, the checks that hold for every model, the fingerprint that tells the SP
ranks' images apart; and shard_batch itself on a batch with images (gloo): the text sharded,
the images kept whole in the LocalBatch, a refused key a Refused on every rank."""

import pytest
import torch

import seqpar
from seqpar.batch.local_batch import BATCH_KWARG
from seqpar.batch.visual import (
    REFUSED_KEYS,
    ROUTED_KEYS,
    SPAN_KEYS,
    fingerprint,
    refused_key_problem,
    visual_problem,
)
from seqpar.comm.launch import run_distributed
from seqpar.errors import Refused

IDS = torch.zeros(2, 6, dtype=torch.long)
GRID = torch.tensor([[1, 2, 2], [1, 2, 4]])  # 4 + 8 patch rows


@pytest.mark.parametrize("extra, problem", [
    ({}, None),
    ({"pixel_values": torch.zeros(12, 5), "image_grid_thw": GRID, "mm_token_type_ids": IDS}, None),
    ({"pixel_values": torch.zeros(3, 3, 8, 8)}, None),  # stacked: one entry per image
    ({"pixel_values": torch.zeros(3, 3, 8, 8), "image_sizes": torch.tensor([[8, 8]] * 3)}, None),
    ({"pixel_values_videos": torch.zeros(8, 5), "video_grid_thw": torch.tensor([[2, 2, 2]])}, None),
    ({"pixel_values": torch.zeros(11, 5), "image_grid_thw": GRID}, "one row per patch of image_grid_thw (12 rows)"),
    ({"pixel_values": torch.zeros(12, 5), "image_grid_thw": GRID.float()}, "positive integers"),
    ({"pixel_values": torch.zeros(12, 5), "image_grid_thw": GRID[:, :2]}, "[n, 3]"),
    ({"video_grid_thw": GRID}, "without pixel_values_videos"),
    ({"pixel_values": torch.zeros(3, 3, 8, 8), "image_sizes": torch.tensor([[8, 8]] * 2)}, "image_sizes has 2"),
    ({"pixel_values": torch.zeros(3, 3, 8, 8), "mm_token_type_ids": IDS[:, :5]}, "mm_token_type_ids must be"),
    ({"pixel_values": [torch.zeros(3, 8, 8)]}, "must be tensors"),
    # per row (Idefics): [B, images, C, H, W] with [B, images, H, W]; SigLIP-2 patches with their shapes
    ({"pixel_values": torch.zeros(2, 2, 3, 8, 8), "pixel_attention_mask": torch.ones(2, 2, 8, 8)}, None),
    ({"pixel_values": torch.zeros(2, 2, 3, 8, 8), "pixel_attention_mask": torch.ones(2, 1, 8, 8)},
     "pixel_attention_mask must match pixel_values"),
    ({"pixel_attention_mask": torch.ones(2, 1, 8, 8)}, "pixel_attention_mask must match pixel_values"),
    ({"pixel_values": torch.zeros(3, 16, 48), "pixel_attention_mask": torch.ones(3, 16),
      "spatial_shapes": torch.tensor([[4, 4]] * 3)}, None),
    ({"pixel_values": torch.zeros(3, 16, 48), "spatial_shapes": torch.tensor([[4, 4]] * 2)},
     "spatial_shapes must be [images, 2]"),
])
def test_visual_problems(extra, problem):
    found = visual_problem({"input_ids": IDS, **extra}, 2, 6)
    assert found == problem if problem is None else problem in found


def test_images_need_input_ids():
    assert "need input_ids" in visual_problem({"inputs_embeds": torch.zeros(2, 6, 4),
                                               "pixel_values": torch.zeros(1, 3, 8, 8)}, 2, 6)


def test_refused_keys_name_their_mechanism():
    assert refused_key_problem({"input_ids": IDS}) is None
    assert not set(REFUSED_KEYS) & set(ROUTED_KEYS)
    # token types are bidirectional spans now: shard_batch keeps them whole (SPAN_KEYS), not refused
    assert refused_key_problem({"input_ids": IDS, "token_type_ids": IDS}) is None and "token_type_ids" in SPAN_KEYS
    why = refused_key_problem({"input_ids": IDS, "pixel_mask": IDS})
    assert "pixel_mask" in why and "a pixel mask per image" in why
    assert "local crops" in refused_key_problem({"pixel_values_local": IDS})
    # images batched per row (Idefics, SmolVLM) are routed now, their pixel mask with them
    assert refused_key_problem({"pixel_attention_mask": IDS}) is None and "pixel_attention_mask" in ROUTED_KEYS


def test_fingerprint_tells_images_apart():
    a = {"pixel_values": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), "image_grid_thw": GRID}
    assert fingerprint(a) == fingerprint({k: v.clone() for k, v in a.items()})
    assert fingerprint(a) != fingerprint({**a, "pixel_values": a["pixel_values"].flip(0)})
    assert fingerprint(a) != fingerprint({**a, "image_grid_thw": GRID.flip(0)})
    assert fingerprint({}) == -1.0


def local_types(local, types):
    batch = local[BATCH_KWARG]
    return "token_type_ids" not in local and torch.equal(batch.token_types, types) and batch.shard.blocks is None


def _worker(rank, world):
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2, 9), generator=g)
    batch = {"input_ids": ids, "labels": ids, "pixel_values": torch.randn(12, 5, generator=g),
             "image_grid_thw": GRID, "mm_token_type_ids": torch.zeros_like(ids)}
    out = {}
    local = seqpar.shard_batch(batch, mesh)
    visual = local[BATCH_KWARG].visual
    out["keys"] = sorted(k for k in local if k != BATCH_KWARG)
    out["visual"] = sorted(visual.tensors)
    out["whole"] = torch.equal(visual.tensors["pixel_values"], batch["pixel_values"]) and \
        torch.equal(visual.input_ids, ids)
    out["piece"] = visual.pieces[rank].tolist()
    out["given"] = visual.positions_given
    out["text only"] = seqpar.shard_batch({"input_ids": ids}, mesh)[BATCH_KWARG].visual
    out["token types"] = local_types(seqpar.shard_batch({**batch, "token_type_ids": ids % 2}, mesh), ids % 2)
    for name, bad in (("refused", {**batch, "pixel_mask": torch.zeros_like(ids)}),
                      ("one rank's images", {**batch, "pixel_values": batch["pixel_values"] + (rank == 1)})):
        try:
            seqpar.shard_batch(bad, mesh)
            out[name] = None
        except ValueError as e:
            out[name] = (type(e).__name__, str(e))
    return out


@pytest.mark.distributed
def test_shard_batch_keeps_the_images_whole_and_refuses_on_every_rank():
    outs = run_distributed(_worker, 2)
    for rank, out in enumerate(outs):
        assert out["keys"] == ["input_ids", "labels", "position_ids", "shift_labels", "use_cache"]
        assert out["visual"] == ["image_grid_thw", "mm_token_type_ids", "pixel_values"]
        assert out["whole"] and out["given"] is False and out["text only"] is None
        assert out["piece"] == list(range(5 * rank, 5 + 4 * rank))
        kind, msg = out["refused"]
        assert kind == Refused.__name__ and "pixel_mask" in msg and "a pixel mask per image" in msg
        assert out["token types"]  # kept whole, for the model's family to make span ids of
        kind, msg = out["one rank's images"]
        assert kind == "ValueError" and "the images / video" in msg and "differs across ranks" in msg
    assert outs[0]["refused"] == outs[1]["refused"]
