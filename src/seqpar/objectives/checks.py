"""An objective call's inputs checked before the model runs, agreed over the SP group (a dynamic
schedule's bin: its block's): a problem on
any rank raises the same ValueError on every rank (one small all-gather, :mod:`seqpar.comm.agree`),
so a bad input never leaves a peer waiting in the forward's collectives."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..batch.local_batch import BATCH_KWARG, LocalBatch
from ..batch.loss import bin_group
from ..comm.agree import check, share
from ..comm.mesh import Axis, axis_group
from ..errors import Refused
from ..integrations.peft import unwrap_peft
from .reference import Reference, check_reference
from .rows import batch_sequences
from .tokens import local_targets

Objective = Any  # a seqpar.objectives.seam.Objective (not imported: the seam imports this module)


def route(objective: Objective, name: str, value: Tensor, seq_len: int) -> str:
    """How an input travels: "token" (``[B, S, ...]`` aligned with the labels, sharded with them),
    "pair" (one per pair), "scalar" (a batch-level number), or "row" (one per sequence)."""
    needs = objective.needs
    if name in needs.per_token or (value.dim() >= 2 and value.shape[1] == seq_len and name not in needs.per_row):
        return "token"
    if name in needs.per_pair:
        return "pair"
    if value.dim() == 0 and name in needs.optional:
        return "scalar"
    return "row"


def validate(objective: Objective, model: nn.Module, local: dict[str, Any], inputs: dict[str, Tensor],
             reference: Reference, num_units: float | None) -> None:
    """Raise ValueError for a call the objective cannot run (no communication)."""
    batch = local.get(BATCH_KWARG)
    if not isinstance(batch, LocalBatch):
        raise ValueError(f"{objective.name} runs on a sharded batch: pass seqpar.shard_batch(batch, mesh)")
    needs = objective.needs
    known = {*needs.per_row, *needs.per_token, *needs.optional, *needs.per_pair}
    if needs.reference:
        known.add("ref_logps")
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise ValueError(f"{objective.name} takes no input {unknown}: it reads {sorted(known)}")
    missing = sorted(set(needs.per_row) | set(needs.per_token)) - inputs.keys()
    if missing:
        raise ValueError(f"{objective.name} needs the input(s) {sorted(missing)}")
    if needs.reference and reference is None and "ref_logps" not in inputs:
        raise ValueError(f"{objective.name} needs reference log-probs: pass reference= (a frozen copy, or "
                         "'adapters_off') or a ref_logps input")
    if reference is not None and "ref_logps" in inputs:
        raise ValueError("pass reference= or ref_logps, not both")
    check_reference(reference, model)
    if num_units is not None and not num_units > 0:
        raise ValueError(f"num_units={num_units!r}: the global count of {objective.unit}s must be positive")
    if objective.takes.per_token:
        local_targets(local)
    ref = next(v for k, v in local.items() if k in ("input_ids", "inputs_embeds"))
    count = batch_sequences(batch.shard, ref.shape[0], ref.device)[2]
    seq_len = sum(batch.shard.seq_lens)
    if needs.rows == "pairs":
        if count % 2:
            raise ValueError(f"{objective.name} compares chosen and rejected sequences, but the batch holds {count} "
                             "sequences: an even number is needed")
        if objective.pairing not in ("halves", "interleaved"):
            raise ValueError(f"pairing={objective.pairing!r}: use 'halves' (chosen rows then rejected rows, TRL's "
                             "order) or 'interleaved' (chosen, rejected, chosen, ...)")
    for name, value in inputs.items():
        kind = route(objective, name, value, seq_len)
        if kind == "token" and (value.dim() < 2 or value.shape[0] != ref.shape[0] or value.shape[1] != seq_len):
            raise ValueError(f"{objective.name}: input {name!r} is per token: give it [batch, {seq_len}] (whole rows, "
                             f"aligned with the labels), got {list(value.shape)}")
        n = count // 2 if kind == "pair" else count
        if kind in ("pair", "row") and (value.dim() == 0 or value.shape[0] != n):
            per = "pair" if kind == "pair" else "sequence: a row, or a packed document"
            raise ValueError(f"{objective.name}: input {name!r} has shape {list(value.shape)}, but the batch needs {n} "
                             f"values (one per {per})")


def refuse_router_aux(objective: Objective, model: nn.Module) -> None:
    """Refused for a MoE model that outputs router logits (``output_router_logits``): its forward
    computes a load-balancing aux loss the model's own loss adds, which an objective's loss does not
    (yet) -- so it would be silently left out. The same on every rank (the model's config)."""
    config = getattr(unwrap_peft(model), "config", None)
    configs = [config, getattr(config, "text_config", None)]
    if any(getattr(c, "output_router_logits", False) for c in configs if c is not None):
        raise Refused(f"{objective.name}: the model outputs MoE router logits (output_router_logits=True), whose aux "
                      "loss seqpar's objectives do not add yet: set output_router_logits=False in its config (no aux "
                      "loss), or train it through the model's own loss (seqpar.parallelize + model(**local).loss)")


def agree(objective: Objective, model: nn.Module, local: dict[str, Any], mesh: DeviceMesh,
          inputs: dict[str, Tensor], reference: Reference, num_units: float | None) -> None:
    """:func:`validate` on every SP rank; the same ValueError on all of them if any has a problem."""
    try:
        validate(objective, model, local, inputs, reference, num_units)
        problem = None
    except ValueError as e:
        problem = str(e)
    group = axis_group(mesh, Axis.SP.value)
    batch = local.get(BATCH_KWARG)
    if isinstance(batch, LocalBatch):  # a dynamic schedule's bin: over its block's ranks
        group = bin_group(mesh, batch, group)
    check(share({}, group, problem=problem), what=f"{objective.name} call")
