"""Whole-model parity on an N-D mesh (tp x sp, dp x tp x sp): the same batch with and without seqpar.

The engine of the tensor-parallel tests, built on :mod:`.model_parity`'s pieces: every rank builds
the same float64 model and full batch; the reference is the unmodified model on the whole batch
(:func:`~.model_parity.reference_grads`); the parallel run is ``parallelize`` (TP by the model's
plan, then SP) + ``shard_batch`` + ``sync_gradients`` on a deep copy. Every rank compares its loss
with the reference's and every parameter's gradient -- ``.full_tensor()`` of a DTensor gradient
(a TP shard, gathered over tp), the tensor itself otherwise. Returns rows; asserting is the tests'.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..batch.loss import sync_gradients
from ..batch.sharding import shard_batch
from ..comm.mesh import init_mesh, mesh_dims
from ..errors import Refused
from ..integrations.distributed.fsdp import apply_fsdp
from ..integrations.hf.parallelize import parallelize
from ..integrations.memory.switches import reduce_memory
from ..integrations.models import decoder_config
from .model_parity import (
    F32_RTOL,
    GRAD_TOL,
    LOSS_TOL,
    Floor,
    ModelCase,
    case_batch,
    make_model,
    model_floor,
    param_group,
    parity_attention,
    reference_grads,
)


@dataclass(frozen=True)
class NdCase:
    """One N-D parity case: a :class:`~.model_parity.ModelCase` (model, batch kind, length, heads,
    config overrides, strategy, layout) and how the parallel copy runs: ``fsdp`` (FSDP2 over
    ``"dp_sp"`` instead of ``sync_gradients``), ``memory`` (the :func:`seqpar.reduce_memory`
    switches: tiled loss, tiled MLP, layer checkpoints)."""

    base: ModelCase
    fsdp: bool = False
    memory: bool = False

    def label(self) -> str:
        return " ".join([self.base.label(), *["fsdp"] * self.fsdp, *["memory"] * self.memory])


def nd_case(model: str, batch: str, seq: int, strategy: str = "ulysses", **kw: Any) -> NdCase:
    """An :class:`NdCase` with the model's parity attention (float64 eager for softcap models)."""
    base_kw = {k: kw.pop(k) for k in ("heads", "kv_heads", "layout", "config") if k in kw}
    base = ModelCase(model=model, batch=batch, seq=seq, strategy=strategy, attn=parity_attention(model), **base_kw)
    return NdCase(base, **kw)


def _full(t: Tensor | None) -> Tensor | None:
    """A gradient as one whole tensor: ``.full_tensor()`` of a DTensor, the tensor itself otherwise."""
    if t is None:
        return None
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


@dataclass
class NdRow:
    """One case on one rank: the loss difference, the largest gradient difference (by group), the
    worst parameter, and the tolerances the model's own float32 steps allow (``floor``)."""

    label: str
    layout: str
    loss_ref: float = 0.0
    loss_diff: float = 0.0
    loss_tol: float = LOSS_TOL
    grad_diff: dict[str, float] = field(default_factory=dict)
    grad_max: float = 0.0
    worst_param: str = ""
    f32_rel: float = 0.0
    params: int = 0
    refused: str = ""

    @property
    def ok(self) -> bool:
        return not self.refused and self.loss_diff <= self.loss_tol and self.grad_max <= GRAD_TOL \
            and self.f32_rel <= F32_RTOL


def run_case(case: NdCase, mesh: DeviceMesh) -> NdRow:
    """One case on ``mesh`` (every rank of it calls this together; module doc)."""
    model = make_model(case.base)
    vocab = decoder_config(model.config)[0].vocab_size
    batch = case_batch(case.base, vocab)
    packed = batch if case.base.batch == "packed" else case_batch(replace(case.base, batch="packed"), vocab)
    floor = model_floor(model, [packed] if packed is batch else [packed, batch])
    dims = mesh_dims(mesh)
    row = NdRow(case.label(), dims.describe())
    ref_loss, ref_grads = reference_grads(model, batch, loss_scale=dims.sp)
    sp_model = copy.deepcopy(model)
    try:
        parallelize(sp_model, mesh, strategy=case.base.strategy)
    except Refused as e:
        row.refused = str(e)
        return row
    if case.memory:
        reduce_memory(sp_model, mesh)
    if case.fsdp:
        apply_fsdp(sp_model, mesh)
    local = shard_batch(batch, mesh, layout=case.base.layout)
    loss = sp_model(**local).loss
    loss.backward()
    if not case.fsdp:
        sync_gradients(sp_model, mesh)
    _compare(row, sp_model, ref_loss, ref_grads, float(loss.detach()), floor)
    return row


def _compare(row: NdRow, sp_model: nn.Module, ref_loss: float, ref_grads: dict[str, Tensor | None], loss: float,
             floor: Floor) -> None:
    """Fill ``row``: a model with a float32 step anywhere (``floor``) is compared at float32
    precision (relative, :data:`F32_RTOL`), as :func:`~.model_parity.compare_models` does."""
    row.loss_ref, row.loss_diff = ref_loss, abs(loss - ref_loss)
    row.loss_tol = max(LOSS_TOL, F32_RTOL * abs(ref_loss)) if floor else LOSS_TOL
    for name, q in sp_model.named_parameters():
        mine, theirs = _full(q.grad), ref_grads[name]
        if mine is None and theirs is None:
            continue
        whole = _full(q.detach())
        mine = mine if mine is not None else torch.zeros_like(whole)
        theirs = theirs if theirs is not None else torch.zeros_like(whole)
        d = float((mine - theirs).abs().max())
        row.params += 1
        if floor and d > GRAD_TOL:
            row.f32_rel = max(row.f32_rel, d / max(float(theirs.abs().max()), 1e-30))
            continue
        grp = param_group(name)
        row.grad_diff[grp] = max(row.grad_diff.get(grp, 0.0), d)
        if d >= row.grad_max:
            row.grad_max, row.worst_param = d, name


def run_nd_parity(rank: int, world: int, layouts: list[dict[str, int]], cases: list[NdCase]) -> list[dict[str, Any]]:
    """Every case on the mesh of every layout (``init_mesh`` keyword arguments: ``tp``, ``sp``,
    ``dp_shard``, ``ulysses``, ``ring``...); this rank's rows as dicts (with ``ok``). A case whose
    strategy is ``hybrid`` runs on the layouts that have ``ulysses`` and ``ring``; the others on the rest."""
    torch.set_num_threads(1)
    rows = []
    for layout in layouts:
        mesh = init_mesh(device_type="cpu", **layout)
        hybrid = "ulysses" in layout and "ring" in layout
        for case in cases:
            if (case.base.strategy == "hybrid") == hybrid:
                row = run_case(case, mesh)
                rows.append({**row.__dict__, "ok": row.ok, "rank": rank})
        dist.barrier()
    return rows
