"""Sharding a batch along the sequence: every SP rank gets the whole batch, keeps its slice.

``shard_batch`` does all the batch-level work once, before the model runs: it shifts labels (so the
target of a shard's last token, which lives on the next rank, is not lost), derives packed-document
segments from position ids, builds the global key mask and the layout permutation into a
:class:`~seqpar.attention.shard.SeqShard`, counts the targets the loss is normalized by, and validates the
batch across the SP ranks with one small all-gather (:mod:`seqpar.batch.validate`). Each rank's
:class:`~seqpar.batch.local_batch.LocalBatch` carries what it knows of the whole batch; attention
layers then read the SeqShard in it and add no collective of their own::

    full batch (same on every SP rank)       input_ids [B, S], labels [B, S], attention_mask [B, S]
      | shift labels, segments, key mask     targets [B, S]: target of position i is labels[i + 1]
      | layout permutation + tensor_split    rank r keeps layout_indices(S, P, layout)[r]
    local batch (rank r)                     input_ids [B, S_r], position_ids [B, S_r], labels [B, S_r]

Lengths not divisible by P give uneven shards (``tensor_split``: the first ``S % P`` ranks hold one
more token); nothing is padded.

Targets, packed-document segments and padding follow the rules of :mod:`seqpar.batch.targets`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..attention.layout import LAYOUTS, document_cuts, layout_indices, min_seq_len
from ..attention.shard import BatchState, SeqShard
from ..comm import collectives, faults
from ..comm.collectives import comm_device
from ..comm.mesh import Axis, as_mesh, axis_group, axis_size, dp_size, has_axis
from ..errors import TargetsLeftOut
from .local_batch import BATCH_KWARG, LocalBatch
from .targets import IGNORE_INDEX, prepare_batch, target_count, targets_after_padding
from .validate import check_batch
from .visual import visual_batch


def _ulysses_degree(mesh: DeviceMesh) -> int:
    return axis_size(mesh, Axis.ULYSSES.value) if has_axis(mesh, Axis.ULYSSES.value) else 1


def shard_batch(batch: Mapping[str, Any], mesh: DeviceMesh, *, layout: str = "contiguous",
                num_items_in_batch: int | float | Tensor | None = None,
                ignore_index: int = IGNORE_INDEX, device: torch.device | str | None = None,
                grad_ranks: int | None = None) -> dict[str, Any]:
    """This SP rank's slice of a full batch, ready for ``model(**local)``.

    Args:
        batch: the full batch, identical on every SP rank of a dp group: ``input_ids [B, S]`` (or
            ``inputs_embeds [B, S, E]``), optional ``labels [B, S]`` (unshifted, ``ignore_index``
            for no target), ``attention_mask [B, S]`` (padding), ``position_ids [B or 1, S]``
            (packed rows restart), ``loss_weights [B, S]`` (per-label weight); and a vision-language
            processor's outputs (:data:`~seqpar.batch.visual.ROUTED_KEYS`: pixels, grids, sizes,
            ``mm_token_type_ids``), kept whole in the LocalBatch for the model to divide over the ranks.
        mesh: a DeviceMesh with an ``"sp"`` axis (and optionally ``"dp"``): :func:`seqpar.init_mesh`.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"doc-zigzag"`` (zigzag inside every packed
            document and padding run of the batch: balances ring attention on packed rows; see
            :mod:`seqpar.attention.layout`).
        num_items_in_batch: the loss denominator N for the whole optimizer step (all dp ranks and
            micro-batches: :func:`seqpar.count_target_tokens`). Default: this batch's targets.
        device: where the returned tensors go (default: the batch's device). A DataLoader's CPU
            batch with ``device="cuda"`` moves only this rank's shard to the GPU, once.

    Returns ``{"input_ids" (or "inputs_embeds"), "position_ids", "labels", "shift_labels",
    "use_cache": False, "seqpar_batch": LocalBatch}`` with every tensor ``[B, S_local, ...]``;
    ``labels`` are already shifted (``shift_labels`` is the same tensor, so that transformers'
    own loss would not shift them again). Costs one small all-gather.

    On an N-D mesh with tp > 1 (:func:`seqpar.init_mesh`) the tp ranks of an SP group take the same
    full batch and the same shard (they split the model, not the tokens); the check below spans them.

    Raises ValueError on every SP rank if a rank's batch is malformed or already sharded, if the
    ranks' batches differ or are not the same batch number (a rank skipped one), or if the mesh has
    no ``"sp"`` axis; :class:`~seqpar.errors.RankFailed` (without communicating) after another
    rank's fault that has not resolved (:func:`seqpar.comm.faults.before_batch`).
    """
    group = axis_group(as_mesh(mesh, "shard_batch"), Axis.SP.value)
    generation = faults.before_batch(tuple(mesh.mesh.flatten().tolist()))  # counted over the mesh's ranks
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = float(num_items_in_batch.item())
    p, me = dist.get_world_size(group), dist.get_rank(group)
    ref = batch.get("input_ids") if batch.get("input_ids") is not None else batch.get("inputs_embeds")
    batch_device = ref.device if isinstance(ref, Tensor) else torch.device("cpu")
    cdev = comm_device(group)  # NCCL with a CPU batch: collectives and the SeqShard on the GPU
    # with tp > 1 the tp ranks of an sp group hold the same batch too: checked over sp x tp
    same = axis_group(mesh, Axis.SP_TP.value) if has_axis(mesh, Axis.SP_TP.value) else group
    _, s = check_batch(batch, same, layout, num_items_in_batch, cdev, generation)
    # the arguments below are now known to agree across the SP ranks: raising is safe
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {list(LAYOUTS)}")
    if num_items_in_batch is not None and num_items_in_batch <= 0:
        raise ValueError(f"num_items_in_batch must be positive, got {num_items_in_batch}")

    prep = prepare_batch(batch, ignore_index)
    _tell_targets_left_out(batch, prep.key_keep, ignore_index)
    # doc-zigzag follows this batch's documents and padding: every SP rank holds the same (checked)
    # batch, so every rank derives the same cuts and permutation without communicating
    cuts = document_cuts(prep.segments, prep.key_keep) if layout == "doc-zigzag" else None
    pieces = layout_indices(s, p, layout, _ulysses_degree(mesh), cuts)
    seq_lens = tuple(int(t.numel()) for t in pieces)
    if min(seq_lens) == 0:  # transformers' attention reshapes cannot take an empty shard
        raise ValueError(f"a sequence of {s} tokens leaves an SP rank without tokens with sp={p} and layout="
                         f"{layout!r} (shard lengths {list(seq_lens)}): use sequences of at least "
                         f"{min_seq_len(p, layout, _ulysses_degree(mesh))} tokens or a smaller sp")
    perm = torch.cat(pieces).to(batch_device) if layout != "contiguous" else None
    idx = pieces[me].to(batch_device)

    def in_layout(t: Tensor | None) -> Tensor | None:
        return None if t is None or perm is None else t.index_select(1, perm)

    def on_comm(t: Tensor | None) -> Tensor | None:  # the batch's metadata moves once, here
        return None if t is None else t.to(cdev)

    shard = SeqShard(seq_lens, on_comm(perm),
                     on_comm(prep.key_keep if perm is None else in_layout(prep.key_keep)),
                     on_comm(prep.segments if perm is None else in_layout(prep.segments)), BatchState(mesh))

    def local(t: Tensor) -> Tensor:  # [B, S_local, ...] on `device`
        mine = t.index_select(1, idx)
        return mine if device is None else mine.to(device)

    denominator = target_count(prep, ignore_index) if num_items_in_batch is None else float(num_items_in_batch)
    info = LocalBatch(shard, sp_rank=me, sp_size=p, dp_size=dp_size(mesh),
                      denominator=denominator, num_items_in_batch=num_items_in_batch,
                      loss_weights=None if prep.weights is None else local(prep.weights), grad_ranks=grad_ranks)
    out: dict[str, Any] = {}
    if batch.get("input_ids") is not None:
        out["input_ids"] = local(batch["input_ids"])
    else:
        out["inputs_embeds"] = local(batch["inputs_embeds"])
    out["position_ids"] = local(prep.position_ids)
    if prep.targets is not None:
        out["labels"] = local(prep.targets)
        out["shift_labels"] = out["labels"]
    out["use_cache"] = False
    positions_given = batch.get("position_ids") is not None or batch.get("cu_seq_lens_q") is not None
    info.visual = visual_batch(batch, pieces, positions_given, prep.segments)  # the model encodes and routes it
    info.positions_given = positions_given
    info.token_types = batch.get("token_type_ids")  # whole rows: the model's family makes them span ids
    out[BATCH_KWARG] = info
    return out


_told: set[str] = set()
"""What this process was told once already (a fixed vocabulary: "left padding")."""


def _tell_targets_left_out(batch: Mapping[str, Any], key_keep: Tensor | None, ignore_index: int) -> None:
    """Once per process, on rank 0: how many labels of this batch the padding rule of
    :mod:`seqpar.batch.targets` leaves out that transformers' sdpa loss would count. Counted from
    the full batch on this rank (no communication); after the first warning, nothing is counted."""
    labels = batch.get("labels")
    if labels is None or key_keep is None or "left padding" in _told or dist.get_rank() != 0:
        return
    n = targets_after_padding(labels, key_keep, ignore_index)
    if n:
        _told.add("left padding")
        warnings.warn(f"{n} label(s) of this batch are no position's target: the first real token of a left-padded "
                      "row, which only the padding position before it could predict. seqpar (its loss and every "
                      "seqpar.objectives objective) gives a padding position no target; transformers' own loss counts "
                      "them with sdpa (NaN with eager), so its loss differs by these tokens. Give that token "
                      f"ignore_index ({ignore_index}) or pad on the right to make this go away (docs/guides/"
                      "training-loop.md: 'Which positions have a target'). Said once per process, on rank 0.",
                      TargetsLeftOut, stacklevel=3)


def count_target_tokens(batches_or_labels: Mapping[str, Any] | Tensor | Sequence[Mapping[str, Any] | Tensor],
                        mesh: DeviceMesh | None = None, *, ignore_index: int = IGNORE_INDEX) -> int | float:
    """The loss denominator of an optimizer step: the number of targets (after shifting, with the
    rules of :func:`shard_batch`) in these full batches, summed over the dp ranks of ``mesh``.

    Pass every micro-batch this rank will run in the step; give the result to ``shard_batch(...,
    num_items_in_batch=...)`` of each. A bare labels tensor counts ``labels[:, 1:] != ignore_index``.
    With loss weights, returns their sum (a float). One all-reduce over dp when dp > 1.
    """
    items = [batches_or_labels] if isinstance(batches_or_labels, (Tensor, Mapping)) else list(batches_or_labels)
    total, weighted = 0.0, False
    for item in items:
        if isinstance(item, Tensor):
            total += float((item[:, 1:] != ignore_index).sum())
            continue
        prep = prepare_batch(item, ignore_index)
        weighted |= prep.weights is not None
        total += target_count(prep, ignore_index)
    if mesh is not None and dp_size(as_mesh(mesh, "count_target_tokens")) > 1:
        dp_group = axis_group(mesh, Axis.DP.value)
        t = torch.tensor([total], dtype=torch.float64, device=comm_device(dp_group))
        collectives.all_reduce(t, group=dp_group)
        total = float(t.item())
    return total if weighted else int(round(total))
