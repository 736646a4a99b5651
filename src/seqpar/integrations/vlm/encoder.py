"""Vision-language models under sequence parallelism: images encoded once, divided over the SP ranks.

``parallelize`` installs :func:`install_vision`'s forward pre-hook on the model. A batch from
:func:`seqpar.shard_batch` carries the whole batch's images in its LocalBatch
(:class:`~seqpar.batch.visual.VisualBatch`); before the model runs, the hook::

    positions     M-RoPE models: the model's own get_rope_index on the whole rows, this rank's
                  slice -> position_ids [3, B, S_local] (what the unsharded model computes)
    encode        this rank's share of the units (:mod:`~seqpar.integrations.vlm.routing`: images, video
                  frames; balanced by pixels) through the model's own get_image_features / get_video_features
    agree         one small all-gather: every rank's feature-row counts, and any rank's failure
    route         one all-to-all with autograd (:func:`seqpar.comm.route.route_rows`): each feature
                  row to the rank whose shard holds its placeholder token
    merge         mm_encoder_outputs={"image": ..., "video": ...} with this rank's rows, in its
                  placeholder order: the model's own masked_scatter merges them, as in transformers'
                  chunked prefill (feature row i fills the i-th placeholder)

Gradients of the vision tower flow back through the all-to-all to the rank that encoded each
image; summing parameter gradients over the SP ranks (sync_gradients, FSDP2) completes them.

Bidirectional spans (Gemma 3's images, PaliGemma's prefix) come from the batch's whole-row
``token_type_ids`` (:mod:`~seqpar.integrations.vlm.spans`), put in the batch's SeqShard by the same hook before the
first layer. Never silently wrong, never a hang: which families run is declared by mechanism in
:mod:`~seqpar.integrations.vlm.families`; a family with a mechanism seqpar cannot run exactly (Gemma 4's per-layer
image masks, cross-attention, encoder-decoders...) is refused by that mechanism's name; pixels or other
multimodal inputs passed to the model directly (not through shard_batch) are a ValueError. All of
it raised before the hook's first collective, from facts every rank shares (the checked batch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...batch.local_batch import BATCH_KWARG, LocalBatch
from ...batch.visual import REFUSED_KEYS, ROUTED_KEYS, SPAN_KEYS, VisualBatch
from ...comm.agree import MISSING, share
from ...comm.mesh import Axis, axis_group
from ...comm.route import route_rows
from ...errors import Refused
from .families import family_problem, frames_apart, per_row, placeholder_token
from .features import FeatureLayout, encoder_output, encoder_rows
from .positions import mrope_positions
from .routing import MODALITIES, PIXELS, RoutePlan, assign, merge_inputs, route_plan, units
from .spans import apply_spans


def is_vision_language(model: nn.Module) -> bool:
    """Whether ``model`` has a vision entry point (transformers' public ``get_image_features``)."""
    return any(callable(getattr(m, f"get_{k}_features", None)) for m in (model, getattr(model, "base_model", model))
               for k in MODALITIES)


def direct_input_problem(model: nn.Module, kwargs: dict[str, Any]) -> tuple[str, bool] | None:
    """``(why, refused)`` if a vision-language model was called with multimodal inputs seqpar
    did not route (raw pixels, grids, token types), else None. Pure: every rank of a call gets the
    same keys, so each raises alike before any collective."""
    if not is_vision_language(model):
        return None
    for key, why in REFUSED_KEYS.items():
        if kwargs.get(key) is not None:
            return f"seqpar does not run {key!r} under sequence parallelism: {why}", True
    for key in SPAN_KEYS:  # the model would build a dense mask of the local shard from them
        if kwargs.get(key) is not None:
            return (f"seqpar does not run {key!r} passed to a sequence-parallel model directly (bidirectional "
                    "attention inside each image or prefix needs the whole rows' token types): put them in the "
                    "batch given to seqpar.shard_batch, which makes them spans of seqpar's mask"), True
    direct = [k for k in ROUTED_KEYS if kwargs.get(k) is not None]
    if direct:
        return (f"{direct} passed to a sequence-parallel model directly: each rank would encode every image and "
                "find only its shard's placeholder tokens (a mismatch on some ranks, a hang on the others). Put "
                "them in the batch given to seqpar.shard_batch, which divides the images over the SP ranks"), False
    return None


def _encode_share(model: nn.Module, visual: VisualBatch, p: int, me: int, device: torch.device,
                  dtype: torch.dtype) -> tuple[dict[str, Tensor], dict[str, FeatureLayout]]:
    """This rank's share of the units, encoded: ``({modality: rows [n, W]}, {modality: how the
    rows map back to the model's encoder output})`` (:mod:`~seqpar.integrations.vlm.features`: W is the main features'
    width plus the deepstack layers').

    Every rank calls the encoder exactly once per modality the batch has: a rank whose share holds
    none of a modality encodes that modality's smallest unit and keeps none of its rows. Under
    FSDP2 each call all-gathers the tower's blocks (and their backward reduce-scatters), under DDP
    every rank must use every parameter: equal calls on every rank keep those collectives matched."""
    work = units(visual.tensors, frames_apart(model), per_row(model))
    runs = assign([u.cost for u in work], p)
    share = [work[i] for i in runs[me]]
    feats, layouts = {}, {}
    for modality in dict.fromkeys(u.modality for u in work):  # the batch's modalities, in model order
        mine = [u for u in share if u.modality == modality]
        stand_in = not mine
        if stand_in:
            mine = [min((u for u in work if u.modality == modality), key=lambda u: u.cost)]
        inputs = merge_inputs(mine)[modality]
        # only this rank's share of the pixels moves to the model's device
        rows, layouts[modality] = encoder_rows(model, modality, {k: v.to(device) for k, v in inputs.items()})
        rows = rows[:0] if stand_in else rows  # a stand-in's rows go nowhere (zero gradient back)
        feats[modality] = rows.to(dtype)  # the model casts to its embeddings' dtype before merging
    return feats, layouts


def _agree(feats: dict[str, Tensor], layouts: dict[str, FeatureLayout], error: BaseException | None,
           group: dist.ProcessGroup) -> tuple[list[dict[str, int]], int]:
    """One all-gather: every rank's feature-row counts and row layout, and any rank's failure
    (raised on every rank). Returns ``(rows per rank per modality, routed row width)``."""
    facts = {f"rows.{m}": float(feats[m].shape[0]) if m in feats else 0.0 for m in MODALITIES}
    for m in MODALITIES:  # every rank encodes every modality of the batch (a stand-in at least)
        facts[f"width.{m}"] = float(layouts[m].width) if m in layouts else MISSING
        facts[f"streams.{m}"] = float(len(layouts[m].widths)) if m in layouts else MISSING
    facts["value_error"] = float(isinstance(error, ValueError))
    problem = None if error is None else f"{type(error).__name__}: {error}"
    table = share(facts, group, problem=problem)
    if any(table.problems):
        text = "seqpar: encoding the images failed, so every rank stops here:\n  " + "\n  ".join(
            f"rank {r}: {m}" for r, m in enumerate(table.problems) if m)
        kind = ValueError if max(table.column("value_error")) else RuntimeError
        raise kind(text) from error
    rows = [{m: int(row[f"rows.{m}"]) for m in MODALITIES} for row in table.rows]
    widths = {int(w) for m in MODALITIES for w in table.column(f"width.{m}") if w != MISSING}
    streams = {int(n) for m in MODALITIES for n in table.column(f"streams.{m}") if n != MISSING}
    if len(widths) > 1 or len(streams) > 1:  # one routed tensor holds every modality's rows
        raise ValueError(f"seqpar: the image / video features have different widths {sorted(widths)} or streams "
                         f"{sorted(streams)} across modalities or ranks; seqpar routes them in one tensor")
    return rows, widths.pop() if widths else 0


def _placeholders(model: nn.Module, visual: VisualBatch) -> dict[str, Tensor]:
    """``{modality: [B, S] bool}`` where the whole batch's placeholder tokens are, for the
    modalities the batch has pixels of (the model merges only those)."""
    out = {}
    for m in MODALITIES:
        if PIXELS[m] in visual.tensors:
            name = f"{placeholder_token(model, m)}_token_id"
            token = getattr(model.config, name, None)
            if token is None:
                raise Refused(f"seqpar: {type(model).__name__} has no config.{name}, so seqpar cannot tell which "
                              f"tokens take the {m} features")
            out[m] = visual.input_ids == token
    return out


def _check_rows(masks: dict[str, Tensor], rows: list[dict[str, int]]) -> None:
    for m, mask in masks.items():
        have, want = sum(r[m] for r in rows), int(mask.sum())
        if have != want:
            raise ValueError(f"seqpar: {m} features and {m} tokens do not match: the model encoded {have} feature "
                             f"rows but input_ids holds {want} {m} placeholder tokens (the processor's input_ids and "
                             f"pixels must come from the same call)")


def _merge(routed: Tensor, plan: RoutePlan, masks: dict[str, Tensor],
           layouts: dict[str, FeatureLayout]) -> dict[str, Any]:
    """The model's ``mm_encoder_outputs`` for this rank: each modality's rows in placeholder order,
    in the family's own encoder output (:func:`~seqpar.integrations.vlm.features.encoder_output`)."""
    if plan.order is not None:
        routed = routed.index_select(0, plan.order.to(routed.device))
    out, start = {}, 0
    for m in MODALITIES:
        if m in masks:
            rows = routed[start:start + plan.counts[m]]
            start += plan.counts[m]
            out[m] = encoder_output(rows, layouts[m])
    return out


def route_visual(model: nn.Module, batch: LocalBatch, group: dist.ProcessGroup) -> dict[str, Any]:
    """Encode this rank's share of the batch's images, route the feature rows: the keyword
    arguments the model then takes -- ``mm_encoder_outputs`` (this rank's placeholder rows, in
    order), and ``position_ids [3, B, S_local]`` for an M-RoPE model. Collective over ``group``
    (one all-gather, one all-to-all); raises Refused / ValueError on every rank before them."""
    visual = batch.visual
    kwargs: dict[str, Any] = {}
    p, me = dist.get_world_size(group), dist.get_rank(group)
    problem = family_problem(model)
    if problem is not None:
        raise Refused(f"seqpar: {type(model).__name__} with images: {problem}")
    embed = model.get_input_embeddings().weight
    masks = _placeholders(model, visual)
    pos = mrope_positions(model, visual, me, embed.device)
    if pos is not None:
        kwargs["position_ids"] = pos
    feats, layouts, error = {}, {}, None
    try:
        feats, layouts = _encode_share(model, visual, p, me, embed.device, embed.dtype)
    except Exception as e:  # raised on every rank by _agree, not left to hang the others
        error = e
    rows, width = _agree(feats, layouts, error, group)
    _check_rows(masks, rows)
    plan = route_plan(masks, rows, visual.pieces, me)
    local = [feats[m] for m in MODALITIES if m in feats]
    x = torch.cat(local) if local else embed.new_zeros((0, width))  # [n_local, E]
    routed = route_rows(x, plan.send_index, plan.recv_counts, group=group)  # [n_placeholders_here, E]
    kwargs["mm_encoder_outputs"] = _merge(routed, plan, masks, layouts)
    return kwargs


def install_vision(model: nn.Module, mesh: DeviceMesh) -> Any:
    """Install the vision pre-hook on ``model`` (see the module doc); returns its handle (``.remove()``)."""
    group = axis_group(mesh, Axis.SP.value)

    def vision_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        found = direct_input_problem(module, kwargs)
        if found is not None:
            why, refused = found
            raise (Refused if refused else ValueError)(f"seqpar: {why}")
        batch = kwargs.get(BATCH_KWARG)
        if not isinstance(batch, LocalBatch):
            return None
        apply_spans(module, batch, kwargs, module.get_input_embeddings().weight.device)
        if batch.visual is None:
            return args, kwargs
        if not is_vision_language(module):
            raise ValueError(f"seqpar: the batch has images ({batch.visual}) but {type(module).__name__} takes none")
        kwargs.update(route_visual(module, batch, group))
        return args, kwargs

    return model.register_forward_pre_hook(vision_hook, with_kwargs=True)

