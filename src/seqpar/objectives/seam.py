"""The objective seam: one small definition per training objective, one driver that runs any of them
exactly under sequence parallelism -- in a user's loop and in ``seqpar train``. (The Trainer / TRL
integration keeps TRL's own losses over a sharded stand-in model: :mod:`seqpar.integrations.trl`.)

An objective says three things (class attributes) and one formula (:meth:`Objective.terms`):

    needs    which rows it needs (``"sequences"``, or ``"pairs"``: chosen then rejected), its inputs
             per sequence (advantages, labels) and per token (old log-probs, returns), and whether
             it needs reference log-probabilities
    takes    what it takes from the model: per token (``"logps"``, ``"entropy"``, ``"values"``) or
             per sequence (``"score"``: the score head at the sequence's last real token)
    unit     what its loss is a mean over: ``"pair"``, ``"sequence"`` or ``"token"``

How it reduces, the same for every objective::

    sp      every SP rank holds the per-sequence sums of the whole sequences (one all-reduce,
            :func:`~seqpar.objectives.rows.row_sums`) and computes the same loss from them; the
            gradient reaches each rank's own tokens, scaled for the average over the SP ranks that
            DDP / FSDP2 / :func:`seqpar.sync_gradients` take (the convention of :mod:`seqpar.batch.loss`)
    dp x    loss = (sum of this dp rank's unit losses) / D.  D = its own unit count by default (the
    accum   dp average is then the mean of the dp ranks' means; divide by the accumulation steps
            yourself), or ``num_units`` = the count over every dp rank and micro-batch of the step
            (the exact global mean: each rank's gradient is then scaled by dp for the dp average)
    bins    a dynamic schedule's bin (:class:`seqpar.planner.bins.StepBins`, whole pairs on a block of
            k ranks): the sums are reduced over the block (:func:`~seqpar.batch.loss.bin_group`) and,
            with ``num_units``, the gradient scaled by W / k for the average over all W ranks

Token rule (every objective): the target of position i is token i + 1 of the same document
(:mod:`seqpar.batch.targets`); a position whose target is ignored, padding, or in another document
contributes nothing -- in a left-padded row the padding position before the first real token too.
docs/guides/training-loop.md: "Which positions have a target".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..batch.local_batch import BATCH_KWARG, LocalBatch
from ..batch.loss import ScaleGrad, bin_group
from ..batch.targets import IGNORE_INDEX
from ..batch.tiled_loss import check_tile, tiled_token_stats
from ..batch.tiles import DEFAULT_LOSS_TILE, vocab_tile
from ..comm import faults
from ..comm.guard import check_failures
from ..comm.mesh import Axis, as_mesh, axis_group, dp_size
from ..integrations.memory.tiled_head import check_head, output_head
from ..integrations.peft import unwrap_peft
from .checks import agree, refuse_router_aux, route
from .reference import Reference, reference_token_logps
from .rows import Sequences, local_tokens, row_sums, sequences
from .tokens import final_hidden, local_targets, model_tile, score_head, token_logps_entropy

UNITS = ("pair", "sequence", "token")
TOKEN_QUANTITIES = ("logps", "entropy", "values", "correct")
"""Per-token quantities an objective can take: ``correct`` (the target is the argmax of the logits) has
no gradient; an evaluation reads it."""


@dataclass(frozen=True)
class Needs:
    """Which rows an objective needs and what inputs come with them (see the module doc)."""

    rows: str = "sequences"  # "sequences" or "pairs" (chosen / rejected, see Objective.pairing)
    per_row: tuple[str, ...] = ()  # required inputs, one value per sequence: [N] or [N, ...]
    per_token: tuple[str, ...] = ()  # required inputs [B, S], aligned with the labels
    optional: tuple[str, ...] = ()  # inputs it reads when given (either kind)
    per_pair: tuple[str, ...] = ()  # optional inputs with one value per pair: [N / 2]
    reference: bool = False  # reference log-probs: reference= or a ref_logps input


@dataclass(frozen=True)
class Takes:
    """What an objective takes from the model (see the module doc)."""

    per_token: tuple[str, ...] = ()  # of TOKEN_QUANTITIES
    per_row: tuple[str, ...] = ()  # "score"


@dataclass
class Quantities:
    """What an objective's formula sees. Per-sequence tensors (``row``, ``counts``, :meth:`sums`) are
    the whole sequences' and the same on every SP rank; per-token tensors (``token``) are this rank's
    shard ``[B, S_local]`` and reach the loss only through :meth:`sums`."""

    batch: LocalBatch
    seqs: Sequences
    valid: Tensor  # [B, S_local] bool: the position has a target
    counts: Tensor  # [N] targets per sequence (whole sequences)
    token: dict[str, Tensor]  # [B, S_local]: logps, entropy, values, ref_logps, per-token inputs
    row: dict[str, Tensor]  # [N, ...]: score, ref_logps, per-sequence inputs
    group: Any

    def sums(self, x: Tensor) -> Tensor:
        """Per-sequence sums over the targets of the whole sequences: ``[B, S_local] -> [N]``."""
        return row_sums(x * self.valid, self.seqs, self.group)


@dataclass
class Terms:
    """An objective's result before the dp reduction: ``total`` (the sum of this dp rank's unit
    losses, the same on every SP rank), ``count`` (its units), and detached metrics. ``global_count``:
    ``count`` already covers every dp rank (a num_items_in_batch given to shard_batch)."""

    total: Tensor
    count: float
    metrics: dict[str, Tensor] = field(default_factory=dict)
    global_count: bool = False


@dataclass
class ObjectiveOutput:
    """``loss`` (back-propagate it, then average the gradients over dp x sp: DDP, FSDP2 or
    :func:`seqpar.sync_gradients`), ``metrics`` (detached, the same on every SP rank), ``units`` (the
    batch's own units: targets, sequences or pairs, over its whole sequences; the same on every SP
    rank)."""

    loss: Tensor
    metrics: dict[str, Tensor]
    units: float = 0.0


class Objective:
    """Base of every objective: subclasses set ``needs``, ``takes``, ``unit`` and :meth:`terms`.
    ``obj(model, local, mesh, ...)`` runs :func:`compute`."""

    name: ClassVar[str] = "objective"
    needs: ClassVar[Needs] = Needs()
    takes: ClassVar[Takes] = Takes()
    unit: ClassVar[str] = "sequence"
    metric_names: ClassVar[tuple[str, ...]] = ()
    """The metrics :meth:`terms` returns, each a mean over the batch's units: a caller that weighs them
    by units adds them up over batches and ranks (``seqpar train``), and knows the names on a rank
    that ran no batch."""
    pairing: str = "halves"  # pairs: sequences [chosen..., rejected...] ("halves", TRL's) or "interleaved"

    def terms(self, q: Quantities) -> Terms:
        raise NotImplementedError

    def pairs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(chosen, rejected)`` of a per-sequence tensor ``[N, ...]``."""
        if self.pairing == "interleaved":
            return x[0::2], x[1::2]
        half = x.shape[0] // 2
        return x[:half], x[half:]

    def __call__(self, model: nn.Module, local: dict[str, Any], mesh: DeviceMesh, **kwargs: Any) -> ObjectiveOutput:
        return compute(self, model, local, mesh, **kwargs)


def compute(objective: Objective, model: nn.Module, local: dict[str, Any], mesh: DeviceMesh, *,
            reference: Reference = None, num_units: float | None = None, temperature: float = 1.0,
            tile: int | None = None, **inputs: Tensor) -> ObjectiveOutput:
    """Run ``objective`` on this rank's shard ``local`` (from :func:`seqpar.shard_batch`) of a
    parallelized ``model``: the same loss on every SP rank, equal to the objective on the unsharded
    batch. ``inputs``: the objective's per-sequence ``[N]`` and per-token ``[B, S]`` inputs, whole
    and identical on every SP rank. ``reference``: see :mod:`seqpar.objectives.reference`.
    ``num_units``: the global unit count (see the module doc). ``temperature`` divides the logits.
    ``tile``: tokens per vocabulary tile (default :func:`~seqpar.batch.tiles.vocab_tile`: the
    tiles hold no more than the shard's hidden states, at most the model's ``loss_tile``). Raises
    ValueError for a missing or malformed input (an exception is told to every rank)."""
    mesh = as_mesh(mesh, objective.name)
    if tile is not None:
        check_tile(tile, "tile")
    refuse_router_aux(objective, model)
    agree(objective, model, local, mesh, inputs, reference, num_units)  # the same ValueError on every rank
    with faults.publishing(f"the {objective.name} objective"):
        return _compute(objective, model, local, mesh, reference, num_units, temperature, tile, inputs)


def _compute(objective: Objective, model: nn.Module, local: dict[str, Any], mesh: DeviceMesh,
             reference: Reference, num_units: float | None, temperature: float, tile: int | None,
             inputs: dict[str, Tensor]) -> ObjectiveOutput:
    batch = local[BATCH_KWARG]
    group = bin_group(mesh, batch, axis_group(mesh, Axis.SP.value))  # a dynamic schedule's bin: its block's
    per_token = bool(objective.takes.per_token)  # completion tokens: the labels'
    targets = local_targets(local) if per_token else None
    hidden, out = final_hidden(model, local)  # [B, S_local, H]
    check_failures(group)  # nothing from a failed forward
    dev = hidden.device
    if tile is None and (reference is not None or {"logps", "entropy", "correct"} & set(objective.takes.per_token)):
        # the same tile for the policy and the reference (of the same vocabulary)
        vocab = output_head(unwrap_peft(model)).weight.shape[0]
        tile = vocab_tile(hidden.shape[0] * hidden.shape[1], hidden.shape[-1], vocab, cap=model_tile(model))
    seqs = sequences(batch, hidden.shape[0], dev)
    valid = targets.to(dev) != IGNORE_INDEX if targets is not None else seqs.ids >= 0
    token, row = _from_model(objective, model, hidden, out, targets, seqs, group, temperature, tile)
    if reference is not None:
        token["ref_logps"] = reference_token_logps(reference, model, local, temperature=temperature, tile=tile)
    for name, value in inputs.items():
        if route(objective, name, value, sum(batch.shard.seq_lens)) == "token":
            token[name] = local_tokens(value, batch, dev)
        else:
            row[name] = value.to(dev)
    cdtype = torch.promote_types(hidden.dtype, torch.float32)
    counts = row_sums(valid.to(cdtype), seqs, group).detach()
    q = Quantities(batch, seqs, valid, counts, token, row, group)
    if "ref_logps" in token and "ref_logps" not in row:
        row["ref_logps"] = q.sums(token["ref_logps"].to(cdtype)).detach()
    terms = objective.terms(q)
    denominator = float(num_units) if num_units is not None else max(float(terms.count), 1.0)
    loss = terms.total / denominator
    scale = _grad_ranks(batch, mesh) / _size(group)
    if scale != 1 and (num_units is not None or terms.global_count):  # the average over every rank of their
        loss = ScaleGrad.apply(loss, scale)                              # shares of a global mean
    return ObjectiveOutput(loss, {k: v.detach() for k, v in terms.metrics.items()}, float(terms.count))


def _grad_ranks(batch: LocalBatch, mesh: DeviceMesh) -> float:
    """The ranks the gradients are averaged over: dp x sp, or every rank of the job for a dynamic
    schedule's bin (its sp group is a block of ``k`` ranks, :func:`~seqpar.batch.loss.bin_group`).
    row_sums scales each rank's share by its group's size; the rest of the factor comes here."""
    return float(batch.grad_ranks if batch.grad_ranks is not None else dp_size(mesh) * batch.sp_size)


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _from_model(objective: Objective, model: nn.Module, hidden: Tensor, out: Any, targets: Tensor | None,
                seqs: Sequences, group: Any, temperature: float, tile: int | None
                ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The per-token and per-sequence quantities ``objective.takes`` from the model's hidden state."""
    takes = objective.takes
    token: dict[str, Tensor] = {}
    row: dict[str, Tensor] = {}
    if {"logps", "entropy"} & set(takes.per_token):
        head = output_head(unwrap_peft(model))
        logits = getattr(out, "logits", None)
        if logits is not None:
            check_head(unwrap_peft(model), head, hidden, logits, group)
        token["logps"], token["entropy"] = token_logps_entropy(hidden, head, targets.to(hidden.device),
                                                               temperature=temperature,
                                                               tile=tile)
    if "correct" in takes.per_token:  # evaluation: no gradient, one more pass of the head over the tiles
        head = output_head(unwrap_peft(model))
        token["correct"] = tiled_token_stats(hidden, head, targets.to(hidden.device), tile=tile or DEFAULT_LOSS_TILE)[1]
    if "values" in takes.per_token or "score" in takes.per_row:
        scores = score_head(model)(hidden)  # [B, S_local, K]
        if "values" in takes.per_token:
            token["values"] = scores[..., 0]
        if "score" in takes.per_row:  # the last real token's score: on one rank, 0 on the others
            row["score"] = row_sums(scores * seqs.last[..., None].to(scores.dtype), seqs, group)  # [N, K]
    return token, row
