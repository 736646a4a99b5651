"""The VLM zoo harness (seqpar.testing.vlm_zoo): it enumerates transformers' image-text-to-text mapping
(every class, none picked), seqpar's family table classifies each of them, and each family the
installed transformers can build runs unsharded -- loss and every gradient, vision tower
included -- on a batch made the way its processor would make it. The families the issue names
must run (one per input layout in `make test`, all of them and the whole zoo in `make verify`)."""

import math

import pytest
import torch

from seqpar.integrations.hf.router_losses import model_setting
from seqpar.integrations.vlm.families import FAMILIES, SINCE, SUPPORTED, UNVERIFIED, VQ_TOKENS
from seqpar.testing.vlm_inputs import vlm_batch
from seqpar.testing.vlm_zoo import (
    build_tiny_vlm,
    run_unsharded,
    vision_params,
    vlm_reference,
    vlm_token_loss,
    vlm_types,
)

# the goal families that transformers 5.24 builds: each must run unsharded with images
NAMED = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "gemma3", "llava",
         "llava_next", "llava_onevision", "internvl", "glm4v", "idefics3", "smolvlm", "mistral3", "paligemma"]
WITH_VIDEO = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava_onevision"]
QUICK = ["qwen2_vl", "llava", "gemma3", "idefics3"]  # one per input layout (grid, stacked, token types, per row)
STATUSES = {"runs", "unbuildable", "no inputs", "fails"}
# issue 36: the zoo's MoE families whose model adds the load-balancing aux loss (router logits on, coef 0.1 as
# in the causal-LM zoo). seqpar runs the first five with images, exact at P = 2 and 3 (test_vlm.py); it
# refuses ERNIE 4.5 VL (experts routed by modality), Qwen4-Exp and GLM-5-Next (their text decoders)
ROUTER_AUX = ["qwen3_vl_moe", "qwen3_5_moe", "qwen3_omni_moe_thinker", "glm4v_moe", "minimax_m3_vl", "ernie4_5_vl_moe",
              "qwen4_exp", "glm5_next"]


def test_the_zoo_is_the_whole_mapping_and_every_family_is_classified():
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    assert vlm_types() == sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    assert len(vlm_types()) >= 100
    assert set(vlm_types()) <= set(FAMILIES)  # a new family fails here until someone classifies it
    import transformers
    from packaging.version import Version

    newer = {f for f, v in SINCE.items() if Version(transformers.__version__) < Version(v)}
    assert set(FAMILIES) - set(vlm_types()) == newer  # the rest of the table: families of newer releases only
    assert all(fam.mechanisms for fam in FAMILIES.values())


@pytest.mark.parametrize("family", [f if f in QUICK else pytest.param(f, marks=pytest.mark.heavy) for f in NAMED])
def test_named_families_run_unsharded_with_images(family):
    row = run_unsharded(family)
    assert row.status == "runs", (family, row.detail)
    assert math.isfinite(row.loss) and row.loss > 0
    assert row.images > 0 and row.vision_grads > 0  # the tower and projector are in the gradient
    if family in WITH_VIDEO:
        assert row.videos > 0


@pytest.mark.parametrize("family", [f if f == "qwen3_vl_moe" else pytest.param(f, marks=pytest.mark.heavy)
                                    for f in ROUTER_AUX])
def test_moe_rows_run_with_router_logits_on(family):
    """The VLM zoo's tiny MoE models compute the router aux loss, weighted so that it shows, and the
    float64 reference adds the whole batch's aux term: it is the model's own loss (whose aux loss
    sums in float32), not the token loss alone."""
    model = build_tiny_vlm(family)
    batch = vlm_batch(model)
    out = model(**batch, use_cache=False)
    assert out.aux_loss is not None and float(out.aux_loss.detach()) > 0
    coef = model_setting(model, ("router_aux_loss_coef", "aux_loss_coef"))
    assert coef == 0.1
    ref, _ = vlm_reference(model, batch)
    total, n = vlm_token_loss(model, batch)
    assert abs(ref - float(out.loss.detach())) < 1e-5
    assert abs(ref - float(total.detach()) / n - coef * float(out.aux_loss.detach())) < 1e-5
    assert coef * float(out.aux_loss.detach()) > 0.1  # far above the tolerances: a missing term shows


def test_tiny_models_are_tiny_and_batches_look_like_a_processors():
    model = build_tiny_vlm("qwen2_vl")
    assert sum(p.numel() for p in model.parameters()) < 200_000
    assert all(p.dtype == torch.float64 for p in model.parameters()) and model.training
    batch = vlm_batch(model)
    ids, grid = batch["input_ids"], batch["image_grid_thw"]
    merge = model.config.vision_config.spatial_merge_size
    assert int((ids == model.config.image_token_id).sum()) == int(grid.prod(-1).sum()) // merge ** 2
    assert batch["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    assert int((batch["mm_token_type_ids"] == 1).sum()) == int((ids == model.config.image_token_id).sum())
    assert int((batch["attention_mask"] == 0).sum()) > 0  # a padded row
    assert (batch["labels"][ids == model.config.image_token_id] == -100).all()
    assert vlm_batch(model).keys() == batch.keys() and torch.equal(vlm_batch(model)["input_ids"], ids)  # seeded
    assert any("visual" in n for n in vision_params(model))


@pytest.mark.heavy
def test_every_buildable_family_runs_unsharded():
    rows = [run_unsharded(f) for f in vlm_types()]
    assert {r.status for r in rows} <= STATUSES
    for r in rows:
        if r.status != "runs":
            assert r.detail, r  # transformers' own error, quoted
        else:
            # VQ tokenizers (Apertus 1.5) turn images into discrete codes: no gradient reaches them, by design
            vq = VQ_TOKENS in FAMILIES[r.family].mechanisms
            assert math.isfinite(r.loss) and (r.vision_grads == 0 if vq else r.vision_grads > 0), r
    runs = {r.family for r in rows if r.status == "runs"}
    assert len(runs) >= 45, sorted(runs)
    # what the family table says seqpar runs with images, the zoo runs; what it calls unverified, it cannot
    claimed = {f for f, fam in FAMILIES.items() if set(fam.mechanisms) <= SUPPORTED}
    assert claimed <= runs, sorted(claimed - runs)
    unverified = {f for f, fam in FAMILIES.items() if UNVERIFIED in fam.mechanisms}
    assert not unverified & runs, sorted(unverified & runs)  # it runs now: check it and classify it


def test_span_rules_are_the_models_own():
    """Token types become span ids exactly as the families' modeling files number them (Gemma 3's
    ``get_block_sequence_ids_for_mask``, PaliGemma's prefix), and the families say which rule."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    from seqpar.integrations.vlm.spans import SPAN_RULES, image_runs, prefix

    g = torch.Generator().manual_seed(0)
    types = (torch.rand(3, 29, generator=g) < 0.5).long()
    assert torch.equal(image_runs(types), get_block_sequence_ids_for_mask(types))
    assert torch.equal(prefix(types), torch.where(types == 0, 0, -1))
    assert FAMILIES["gemma3"].spans == "images" and FAMILIES["paligemma"].spans == "prefix"
    assert FAMILIES["paligemma"].one_based and FAMILIES["paligemma"].causal_mask
    assert {f.spans for f in FAMILIES.values()} == {None, *SPAN_RULES}
