"""Sharding a batch along the sequence: every SP rank gets the whole batch, keeps its slice.

``shard_batch`` does all the batch-level work once, before the model runs: it shifts labels (so the
target of a shard's last token, which lives on the next rank, is not lost), derives packed-document
segments from position ids, builds the global key mask and the layout permutation into a
:class:`~seqpar.attention.shard.SeqShard`, counts the targets the loss is normalized by, and validates the
batch across the SP ranks with one small all-gather. Attention layers then read the SeqShard and
add no collective of their own::

    full batch (same on every SP rank)       input_ids [B, S], labels [B, S], attention_mask [B, S]
      | shift labels, segments, key mask     targets [B, S]: target of position i is labels[i + 1]
      | layout permutation + tensor_split    rank r keeps layout_indices(S, P, layout)[r]
    local batch (rank r)                     input_ids [B, S_r], position_ids [B, S_r], labels [B, S_r]

Lengths not divisible by P give uneven shards (``tensor_split``: the first ``S % P`` ranks hold one
more token); nothing is padded.

Targets, packed-document segments and padding follow the rules of :mod:`seqpar.batch.targets`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..attention.layout import LAYOUTS, document_cuts, layout_indices, min_seq_len
from ..attention.shard import BatchState, SeqShard
from ..comm import collectives, faults
from ..comm.agree import MISSING, check, share
from ..comm.collectives import comm_device
from ..comm.mesh import Axis, as_mesh, axis_group, axis_size, dp_size, has_axis
from ..errors import Refused
from .targets import CU_SEQLENS_KEYS, IGNORE_INDEX, cu_seqlens_problem, prepare_batch, target_count
from .visual import (
    ROUTED_KEYS,
    SPAN_KEYS,
    VisualBatch,
    fingerprint,
    refused_key_problem,
    visual_batch,
    visual_problem,
)

BATCH_KWARG = "seqpar_batch"
"""The key under which a sharded batch carries its :class:`LocalBatch` into ``model(**local)``."""

BATCH_KEYS = ("input_ids", "inputs_embeds", "labels", "attention_mask", "position_ids", "loss_weights")


class LocalBatch:
    """What one SP rank knows about the whole batch, computed once by :func:`shard_batch`.

    Travels to the attention function and the loss through ``model(**local)`` keyword arguments.
    A plain class (not a dataclass) so that DDP / FSDP input movers pass it through untouched.

    shard         the :class:`SeqShard` (lengths, layout permutation, global key mask, segments; the
                  batch's plans and failure record live in its state)
    sp_rank       this rank's index in the SP group; sp_size its size; dp_size the data-parallel size
    denominator   N of the loss: ``num_items_in_batch`` if given, else the (weighted) target count
                  of this dp rank's whole batch
    grad_scale    d(out.loss)/d(local sum of token losses): ``dp_size * sp_size / N`` with
                  ``num_items_in_batch`` (N counts every dp rank), else ``sp_size / N`` (N: this dp
                  rank's targets) -- so that the *average* over the dp x sp ranks that DDP / FSDP2 /
                  :func:`seqpar.sync_gradients` take is the exact gradient (see :mod:`seqpar.batch.loss`)
    loss_weights  [B, S_local] per-target weights (shifted with the labels) or None
    visual        the whole batch's images / video (:class:`~seqpar.batch.visual.VisualBatch`) or None
    token_types   ``[B, S]`` the whole rows' ``token_type_ids`` (original order) or None: the model's
                  family turns them into the shard's bidirectional span ids before its first layer
                  (:func:`seqpar.integrations.vlm_spans.with_spans`)
    positions_given  whether the batch brought its own position_ids (else shard_batch made 0..S-1)
    """

    __slots__ = ("shard", "sp_rank", "sp_size", "dp_size", "denominator", "grad_scale", "num_items_in_batch",
                 "loss_weights", "attention_calls", "visual", "token_types", "positions_given")

    def __init__(self, shard: SeqShard, *, sp_rank: int, sp_size: int, dp_size: int, denominator: float,
                 num_items_in_batch: float | None, loss_weights: Tensor | None) -> None:
        self.shard = shard
        self.sp_rank, self.sp_size, self.dp_size = sp_rank, sp_size, dp_size
        self.num_items_in_batch = num_items_in_batch
        self.denominator = denominator
        n = float(denominator) if denominator > 0 else 1.0  # no target at all: the loss is 0, not NaN
        # the ranks' gradients are averaged afterwards: each rank's share is scaled by how many
        # ranks the average divides by (all dp x sp with a global N; sp alone with a per-dp-rank
        # N, whose dp average is then the mean of the dp ranks' means)
        ranks = sp_size * dp_size if num_items_in_batch is not None else sp_size
        self.grad_scale = ranks / n
        self.loss_weights = loss_weights
        self.attention_calls = 0  # how many attention layers read this batch (checked by the loss)
        self.visual: VisualBatch | None = None  # set by shard_batch for a batch with images
        self.token_types: Tensor | None = None  # set by shard_batch for a batch with token_type_ids
        self.positions_given = False

    @property
    def local_len(self) -> int:
        return self.shard.seq_lens[self.sp_rank]

    def __repr__(self) -> str:
        return (f"LocalBatch(seq_lens={self.shard.seq_lens}, sp_rank={self.sp_rank}, denominator={self.denominator:g},"
                f" layout={'contiguous' if self.shard.positions is None else 'permuted'})")


# --------------------------------------------------------------------------------------------
# validation: one all-gather of a row of numbers per batch
# --------------------------------------------------------------------------------------------

def _local_problem(batch: Mapping[str, Any]) -> tuple[str | None, int, int]:
    """``(what is wrong with this rank's batch or None, batch size, seq len)``, without communication."""
    if BATCH_KWARG in batch:
        return ("this batch is already sharded (it carries a seqpar LocalBatch): pass the full batch every SP rank "
                "loaded to shard_batch once"), -1, -1
    ids, emb = batch.get("input_ids"), batch.get("inputs_embeds")
    ref = ids if ids is not None else emb
    if ref is None:
        return "the batch has neither input_ids nor inputs_embeds", -1, -1
    if (ids is not None and ids.dim() != 2) or (ids is None and emb.dim() != 3):
        return "input_ids must be [batch, seq_len] (inputs_embeds [batch, seq_len, hidden])", -1, -1
    b, s = int(ref.shape[0]), int(ref.shape[1])
    refused = refused_key_problem(batch)
    if refused is not None:
        return refused, b, s
    if set(batch) - set(BATCH_KEYS) - set(CU_SEQLENS_KEYS) - {"use_cache"} - set(ROUTED_KEYS) - set(SPAN_KEYS):
        return (f"the batch has keys shard_batch does not know: use only {list(BATCH_KEYS)} (and the "
                f"{list(CU_SEQLENS_KEYS)} of DataCollatorWithFlattening, the {list(ROUTED_KEYS + SPAN_KEYS)} of a "
                "vision-language processor)"), b, s
    labels, mask, pos, w = (batch.get(k) for k in ("labels", "attention_mask", "position_ids", "loss_weights"))
    if labels is not None and tuple(labels.shape) != (b, s):
        return "labels must have the shape of input_ids [batch, seq_len]", b, s
    if mask is not None and tuple(mask.shape) != (b, s):
        return ("attention_mask must be a [batch, seq_len] padding mask (1 = token, 0 = padding); 4-D masks are "
                "not supported -- seqpar builds the attention mask itself"), b, s
    if pos is not None and (pos.dim() != 2 or pos.shape[1] != s or pos.shape[0] not in (1, b)):
        return "position_ids must be [batch, seq_len] or [1, seq_len]", b, s
    if w is not None and (labels is None or tuple(w.shape) != (b, s)):
        return "loss_weights must have the shape of labels [batch, seq_len] and need labels", b, s
    return cu_seqlens_problem(batch, b, s) or visual_problem(batch, b, s), b, s


def checksum(t: Tensor | None) -> float:
    """A cheap fingerprint of an integer tensor, exact in float64, to tell whether SP ranks hold the
    same batch (the classic bug: a data loader sharded over all ranks instead of over dp)."""
    if t is None:
        return MISSING
    flat = t.reshape(-1).to(torch.int64)
    w = torch.arange(flat.numel(), device=flat.device) % 65521 + 1
    return float(((flat % 65521) * w).sum() % 2147483647)


_SAME = {
    "batch": "batch size", "seq": "sequence length (dim 1 of input_ids)", "ids": "the batch content (input_ids)",
    "labels": "the label content", "mask": "the attention_mask content",
    "pos": "the position_ids content",
    "weights": "whether loss_weights are given", "layout": "layout", "items": "num_items_in_batch",
    "visual": f"the images / video (the batch's {list(ROUTED_KEYS + SPAN_KEYS)})",
    "generation": "the batch number (how many batches the rank sharded before: a rank skipped or repeated one, "
                  "e.g. an exception caught and ignored on some ranks; seqpar.comm.faults)",
}


def device_problem(devices: set[torch.device], comm: torch.device) -> str | None:
    """Why a batch whose tensors sit on ``devices`` cannot be sharded for a group that talks on
    ``comm`` (:func:`seqpar.comm.collectives.comm_device`), or None. CPU batches suit every group
    (with NCCL their metadata moves to ``comm`` once); refused: tensors on several devices, and a
    CUDA batch on another GPU than the one this rank's NCCL group uses."""
    if len(devices) > 1:
        return (f"the batch's tensors are on different devices ({', '.join(sorted(map(str, devices)))}): put them "
                "on one device (the CPU, or this rank's GPU)")
    dev = next(iter(devices), torch.device("cpu"))
    if dev.type == "cuda" and comm.type == "cuda" and dev.index != comm.index:
        return (f"the batch is on {dev} but this rank's NCCL group talks on {comm}: call "
                "torch.cuda.set_device(local_rank) before init_process_group, or move the batch to that GPU")
    return None


def _validate(batch: Mapping[str, Any], group: dist.ProcessGroup, layout: str, num_items: float | None,
              device: torch.device, generation: int) -> tuple[int, int]:
    problem, b, s = _local_problem(batch)
    if problem is None:  # found on one rank, raised on every rank by the agreement below
        problem = device_problem({t.device for t in batch.values() if isinstance(t, Tensor)}, device)
    ok = problem is None
    facts = {
        "batch": float(b), "seq": float(s),
        "ids": checksum(batch.get("input_ids")) if ok else MISSING,
        "labels": checksum(batch.get("labels")) if ok else MISSING,
        "mask": checksum(batch.get("attention_mask")) if ok else MISSING,
        "pos": checksum(batch.get("position_ids")) if ok else MISSING,
        "weights": 1.0 if ok and batch.get("loss_weights") is not None else 0.0,
        "layout": float(LAYOUTS.index(layout)) if layout in LAYOUTS else MISSING,
        "items": MISSING if num_items is None else float(num_items),
        "visual": fingerprint({k: batch[k] for k in ROUTED_KEYS + SPAN_KEYS if batch.get(k) is not None})
        if ok else MISSING,
        "refused": float(problem is not None and problem == refused_key_problem(batch)),
        "generation": float(generation),  # no batch pairs with another batch's collectives
    }
    table = share(facts, group, problem=problem, device=device)
    if any(table.column("refused")):  # a mechanism seqpar will not run: a Refused, raised on every rank
        raise Refused("seqpar: invalid batch for shard_batch:\n  " + "\n  ".join(
            f"rank {r}: {msg}" for r, msg in enumerate(table.problems) if msg))
    # a malformed batch makes the comparisons meaningless: report only the problem then
    check(table, what="batch for shard_batch", same=[] if any(table.problems) else list(_SAME),
          describe=lambda n: _SAME[n], hint="every SP rank must get the same full batch: shard the data loader "
                                            "over the dp ranks only (shard_batch splits the sequence)")
    return b, s


# --------------------------------------------------------------------------------------------
# shard_batch
# --------------------------------------------------------------------------------------------

def _ulysses_degree(mesh: DeviceMesh) -> int:
    return axis_size(mesh, Axis.ULYSSES.value) if has_axis(mesh, Axis.ULYSSES.value) else 1


def shard_batch(batch: Mapping[str, Any], mesh: DeviceMesh, *, layout: str = "contiguous",
                num_items_in_batch: int | float | Tensor | None = None,
                ignore_index: int = IGNORE_INDEX, device: torch.device | str | None = None) -> dict[str, Any]:
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
    _, s = _validate(batch, group, layout, num_items_in_batch, cdev, generation)
    # the arguments below are now known to agree across the SP ranks: raising is safe
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {list(LAYOUTS)}")
    if num_items_in_batch is not None and num_items_in_batch <= 0:
        raise ValueError(f"num_items_in_batch must be positive, got {num_items_in_batch}")

    prep = prepare_batch(batch, ignore_index)
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
                      loss_weights=None if prep.weights is None else local(prep.weights))
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
