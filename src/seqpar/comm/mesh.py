"""The device mesh seqpar runs on, with named axes, passed explicitly everywhere.

Axes (outermost first)::

    ("dp", "sp")                   strategy "ulysses" or "ring": sp ranks share one sequence
    ("dp", "ring", "ulysses")      strategy "hybrid": Ulysses inside a ulysses group (keep it
                                   inside a node), ring across; "sp" is their flattened product

A rank's sequence shard is its index along "sp" (ring-major for hybrid): the ulysses group of a
ring step holds consecutive shards, so its all-to-all yields one contiguous ring chunk.

The N-D mesh (``init_mesh`` given any of ``dp_replicate``, ``dp_shard``, ``tp``, ``ep``) has one
dimension per degree, in torchtitan's order (:mod:`seqpar.comm.dims`: tp innermost, inside a host;
the data-parallel dimensions outermost, across hosts)::

    ("dp_replicate", "dp_shard", "sp", "tp")                 ("ring", "ulysses") in place of "sp" for hybrid
    flattened, by name:  "dp"     = dp_replicate x dp_shard     the data-parallel ranks (different batches)
                         "sp"     = ring x ulysses              (hybrid)
                         "dp_sp"  = dp_replicate x dp_shard x sp   where gradients are averaged (never tp)
                         "dp_shard_sp" = dp_shard x sp          what FSDP2 shards over (HSDP: x dp_replicate)
                         "sp_tp"  = sp x tp (tp > 1)            the ranks that hold one batch
    expert parallelism:  :func:`ep_mesh` = "dp_sp" unflattened into ("ep_dp", "ep")

so ``axis_group(mesh, "dp")``, ``"sp"``, ``"ulysses"``, ``"ring"`` mean on it what they mean on the
2-D mesh, and ``"tp"``, ``"dp_sp"``, ``"ep"``, ``"ep_dp"`` name the rest. The flattened views are
kept beside the mesh (:func:`submesh`), not sliced from it again (torch deprecates that).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from enum import Enum
from typing import Generic, TypeVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import compat
from .dims import MeshDims, resolve_dims

V = TypeVar("V")


class Axis(str, Enum):
    DP = "dp"
    SP = "sp"
    ULYSSES = "ulysses"
    RING = "ring"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    TP = "tp"
    DP_SP = "dp_sp"
    DP_SHARD_SP = "dp_shard_sp"
    EP = "ep"
    EP_DP = "ep_dp"
    SP_TP = "sp_tp"


def backend_names(group: dist.ProcessGroup | None = None) -> str:
    """What ``group`` (default: the world) runs, as torch says it: its backend (``"nccl"``,
    ``"gloo"``; ``"undefined"`` for a bare ``init_process_group()``) and its per-device backend
    config (``"cpu:gloo,cuda:nccl"``), comma-joined and lower case."""
    names = [str(dist.get_backend(group))]
    get_config = getattr(dist, "get_backend_config", None)  # torch >= 2.6
    if get_config is not None:
        try:
            names.append(str(get_config(group)))
        except (ValueError, RuntimeError, KeyError):  # a group torch recorded without a config
            pass
    return ",".join(names).lower()


def uses_nccl(group: dist.ProcessGroup | None = None) -> bool:
    """True when ``group`` moves CUDA tensors with NCCL: backend ``"nccl"``, a mixed
    ``"cpu:gloo,cuda:nccl"``, or a bare ``init_process_group()`` on a CUDA build (whose
    ``get_backend()`` is ``"undefined"``; its config names NCCL). Equality with ``"nccl"`` misses
    the last two."""
    return "nccl" in backend_names(group)


def default_device_type() -> str:
    """``"cuda"`` when CUDA is there and the default process group uses NCCL (:func:`uses_nccl`),
    else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() and uses_nccl() else "cpu"


def init_mesh(*, sp: int | None = None, dp: int | None = None, ulysses: int | None = None, ring: int | None = None,
              dp_replicate: int | None = None, dp_shard: int | None = None, tp: int | None = None,
              ep: int | None = None, device_type: str | None = None) -> DeviceMesh:
    """The mesh over all ranks: ``dp x sp``, or N-D with tensor and expert parallelism.

    ``init_mesh(sp=, dp=)`` (``dp`` defaults to ``world // sp``) builds the 2-D ``("dp", "sp")``
    mesh; for a hybrid split give ``ulysses`` and ``ring`` with ``ulysses * ring == sp``: the mesh
    is ``dp x ring x ulysses`` and also carries the flattened ``sp`` axis.

    Any of ``dp_replicate``, ``dp_shard``, ``tp``, ``ep`` builds the N-D mesh (module doc):
    ``dp_replicate x dp_shard x sp x tp`` in that order, outermost first -- tp innermost, so a tp
    group is consecutive ranks (one host), sp next (inside a host too, ring outside ulysses), the dp
    dimensions across hosts. ``dp == dp_replicate * dp_shard``. ``ep`` borrows ``ep`` consecutive
    ranks of ``dp_shard x sp`` for the MoE layers (:func:`ep_mesh`); it adds no ranks. Defaults and
    checks: :func:`seqpar.comm.dims.resolve_dims`.

    Raises ValueError (on every rank: the arguments are the same everywhere) if the sizes do not
    multiply to the world size, or ``ep`` does not divide ``dp_shard * sp``.
    """
    if not dist.is_initialized():
        raise ValueError("init_mesh needs torch.distributed to be initialized (torchrun, or seqpar.comm.launch)")
    world = dist.get_world_size()
    device_type = device_type or default_device_type()
    if dp_replicate is not None or dp_shard is not None or tp is not None or ep is not None:
        dims = resolve_dims(world, sp=sp, dp=dp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
                            ulysses=ulysses, ring=ring, ep=ep)
        return _nd_mesh(dims, device_type)
    if sp is None:
        raise ValueError("init_mesh needs sp=N (and optionally dp, ulysses, ring), or the N-D degrees "
                         "(dp_replicate=, dp_shard=, tp=, ep=)")
    if sp < 1 or world % sp:
        raise ValueError(f"sp={sp} must divide the world size {world}: choose sp in "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}")
    dp = world // sp if dp is None else dp
    if dp * sp != world:
        raise ValueError(f"dp={dp} x sp={sp} = {dp * sp} != world size {world}: set dp={world // sp} or omit it")
    if ulysses is None and ring is None:
        mesh = init_device_mesh(device_type, (dp, sp), mesh_dim_names=(Axis.DP.value, Axis.SP.value))
        _add_grad_groups(mesh, Axis.SP.value)
        return mesh
    ulysses = ulysses if ulysses is not None else sp // (ring or 1)
    ring = ring if ring is not None else sp // ulysses
    if ulysses * ring != sp:
        raise ValueError(f"ulysses={ulysses} x ring={ring} = {ulysses * ring} != sp={sp}")
    mesh = init_device_mesh(device_type, (dp, ring, ulysses),
                            mesh_dim_names=(Axis.DP.value, Axis.RING.value, Axis.ULYSSES.value))
    compat.flatten_mesh(mesh[(Axis.RING.value, Axis.ULYSSES.value)], Axis.SP.value)
    _add_grad_groups(mesh, Axis.RING.value)
    return mesh


def _nd_mesh(dims: MeshDims, device_type: str) -> DeviceMesh:
    """The N-D mesh of ``dims`` with its flattened views kept beside it (module doc). Collective:
    every rank creates every group, in the same order."""
    sp_dims = (Axis.RING.value, Axis.ULYSSES.value) if dims.hybrid else (Axis.SP.value,)
    sp_sizes = (dims.ring, dims.ulysses) if dims.hybrid else (dims.sp,)
    names = (Axis.DP_REPLICATE.value, Axis.DP_SHARD.value, *sp_dims, Axis.TP.value)
    mesh = init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard, *sp_sizes, dims.tp), mesh_dim_names=names)
    kept: dict[str, DeviceMesh] = {}
    if dims.hybrid:
        kept[Axis.SP.value] = compat.flatten_mesh(mesh[sp_dims], Axis.SP.value)
    kept[Axis.DP.value] = compat.flatten_mesh(mesh[(Axis.DP_REPLICATE.value, Axis.DP_SHARD.value)], Axis.DP.value)
    kept[Axis.DP_SP.value] = compat.flatten_mesh(mesh[(Axis.DP_REPLICATE.value, Axis.DP_SHARD.value, *sp_dims)],
                                                 Axis.DP_SP.value)
    kept[Axis.DP_SHARD_SP.value] = compat.flatten_mesh(mesh[(Axis.DP_SHARD.value, *sp_dims)], Axis.DP_SHARD_SP.value)
    if dims.tp > 1:  # the ranks that hold one batch (shard_batch checks they agree)
        kept[Axis.SP_TP.value] = compat.flatten_mesh(mesh[(*sp_dims, Axis.TP.value)], Axis.SP_TP.value)
    if dims.ep > 1:
        kept["ep_mesh"] = compat.unflatten_mesh(kept[Axis.DP_SP.value], (dims.grad_ranks // dims.ep, dims.ep),
                                                (Axis.EP_DP.value, Axis.EP.value))
        kept[Axis.EP.value] = kept["ep_mesh"][Axis.EP.value]
        kept[Axis.EP_DP.value] = kept["ep_mesh"][Axis.EP_DP.value]
    _SUBMESHES.set(mesh, kept)
    _DIMS.set(mesh, dims)
    _add_grad_groups(mesh, Axis.RING.value if dims.hybrid else Axis.SP.value)
    return mesh


class _PerMesh(Generic[V]):
    """Values kept beside a mesh for as long as the mesh lives, found by the mesh's identity; nothing
    is set on the DeviceMesh itself. Not a ``WeakKeyDictionary``: that compares keys with
    ``DeviceMesh.__eq__``, i.e. by contents, so two equal meshes (two ``init_mesh`` calls with the
    same sizes) would share one entry, and it would vanish with the first of them -- whenever the
    cyclic collector frees it, a moment that can differ between ranks, after which ring's dK/dV hops
    would run over different groups on different ranks. Not a dict keyed by ``id()`` either: an id
    is reused after its mesh is gone. A handful of meshes live in a process; a scan is enough."""

    def __init__(self, default: Callable[[], V] = dict) -> None:  # type: ignore[assignment]
        self._entries: list[tuple[weakref.ref[DeviceMesh], V]] = []
        self._default = default  # what a mesh without an entry gets

    def set(self, mesh: DeviceMesh, value: V) -> None:
        self._entries = [(ref, v) for ref, v in self._entries if ref() is not None and ref() is not mesh]
        self._entries.append((weakref.ref(mesh), value))

    def get(self, mesh: DeviceMesh) -> V:
        return next((v for ref, v in self._entries if ref() is mesh), None) or self._default()


_GRAD_GROUPS: _PerMesh[dict[str, dist.ProcessGroup]] = _PerMesh()  # the companion groups of init_mesh's meshes
_SUBMESHES: _PerMesh[dict[str, DeviceMesh]] = _PerMesh()  # the N-D mesh's flattened views, by name
_DIMS: _PerMesh[MeshDims | None] = _PerMesh(lambda: None)  # the degrees an N-D mesh was built with


def _add_grad_groups(mesh: DeviceMesh, axis: str) -> None:
    """A second process group over the ranks of every ``axis`` group, for ring attention's dK/dV
    hops: its own communicator (under NCCL its own stream), so that the backward's float32
    accumulators do not queue behind the next K/V block. Every rank calls this (init_mesh is
    collective) and creates every group, in the same order."""
    dims = list(mesh.mesh_dim_names or ())
    ranks = mesh.mesh.movedim(dims.index(axis), -1).reshape(-1, mesh.mesh.shape[dims.index(axis)])
    if ranks.shape[1] < 2:
        return
    mine, _ = dist.new_subgroups_by_enumeration(ranks.tolist())
    _GRAD_GROUPS.set(mesh, {axis: mine})


def grad_group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup | None:
    """The companion group of ``axis`` for ring dK/dV hops (see :func:`_add_grad_groups`), or None
    for a mesh built without one (ring attention then uses the axis group itself)."""
    return _GRAD_GROUPS.get(mesh).get(axis)


def as_mesh(mesh: object, what: str) -> DeviceMesh:
    """``mesh`` itself if it is a DeviceMesh; else a ValueError naming ``what`` needed it. A bare
    process group is refused: it cannot say which axis it is (sp, dp, ring...)."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"{what} takes a DeviceMesh with named axes (seqpar.init_mesh(sp=...)), got "
                         f"{type(mesh).__name__}; for a process group of your own use "
                         "DeviceMesh.from_group(group, device_type, mesh_dim_names=('sp',))")
    return mesh


def axis_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The axes of ``mesh``: its dimension names, plus ``"sp"`` where seqpar's hybrid mesh carries
    it as the flattened ``ring x ulysses``, plus the N-D mesh's flattened views (module doc)."""
    names = tuple(mesh.mesh_dim_names or ())
    if Axis.SP.value not in names and {Axis.RING.value, Axis.ULYSSES.value} <= set(names):
        names += (Axis.SP.value,)
    return names + tuple(n for n in _SUBMESHES.get(mesh) if n not in names and n != "ep_mesh")


def has_axis(mesh: DeviceMesh, axis: str) -> bool:
    return axis in axis_names(mesh)


def axis_group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup:
    """The process group of one mesh axis. Raises ValueError for a mesh without it."""
    mesh = as_mesh(mesh, f"the {axis!r} axis lookup")
    if not has_axis(mesh, axis):
        hint = {"ulysses": ", ulysses=..., ring=...", "ring": ", ulysses=..., ring=...", "tp": ", tp=...",
                "ep": ", ep=...", "ep_dp": ", ep=..."}.get(axis, "")
        raise ValueError(f"the mesh has no {axis!r} axis (axes: {list(axis_names(mesh))}); build it with "
                         f"seqpar.init_mesh(sp=...{hint})")
    kept = _SUBMESHES.get(mesh).get(axis)
    return kept.get_group() if kept is not None else mesh.get_group(axis)


def submesh(mesh: DeviceMesh, axis: str) -> DeviceMesh:
    """The 1-D mesh of one axis of ``mesh`` (a dimension, or a flattened view the N-D mesh keeps):
    what a DTensor (TP) or ``fully_shard`` (FSDP2) takes. Raises ValueError for a mesh without it."""
    axis_group(mesh, axis)  # the ValueError for a missing axis
    kept = _SUBMESHES.get(mesh).get(axis)
    return kept if kept is not None else mesh[axis]


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    """Size of an axis of ``mesh``. Raises ValueError for a mesh without it."""
    return dist.get_world_size(axis_group(mesh, axis))


def dp_size(mesh: DeviceMesh) -> int:
    """The data-parallel degree: the ``"dp"`` axis, or 1 for a mesh without one (sp ranks only)."""
    return axis_size(mesh, Axis.DP.value) if has_axis(mesh, Axis.DP.value) else 1


def tp_size(mesh: DeviceMesh) -> int:
    """The tensor-parallel degree: the ``"tp"`` axis, or 1 for a mesh without one."""
    return axis_size(mesh, Axis.TP.value) if has_axis(mesh, Axis.TP.value) else 1


def is_nd(mesh: DeviceMesh) -> bool:
    """Whether ``mesh`` is an N-D mesh of :func:`init_mesh` (module doc), not the 2-D ``dp x sp`` one."""
    return _DIMS.get(mesh) is not None


def mesh_dims(mesh: DeviceMesh) -> MeshDims:
    """The degrees of ``mesh``: those an N-D mesh was built with; for a ``dp x sp`` mesh (or any
    mesh with an ``"sp"`` axis) ``dp_shard = dp``, ``tp = ep = 1``."""
    dims = _DIMS.get(mesh)
    if dims is not None:
        return dims
    sp = axis_size(mesh, Axis.SP.value)
    hybrid = has_axis(mesh, Axis.RING.value) and has_axis(mesh, Axis.ULYSSES.value)
    ring = axis_size(mesh, Axis.RING.value) if hybrid else 1
    return MeshDims(dp_shard=dp_size(mesh), sp=sp, ring=ring, ulysses=sp // ring, hybrid=hybrid)


def ep_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D ``("ep_dp", "ep")`` mesh of expert parallelism over ``mesh`` (``init_mesh(..., ep=E)``).

    Contract for the MoE layers: the ``"ep"`` group (``ep_mesh(mesh)["ep"]``, also
    ``axis_group(mesh, "ep")``) is ``E`` consecutive ranks of ``dp_replicate x dp_shard x sp`` at
    this rank's tp index (sp innermost: ep <= sp keeps it inside an sp group), which split the
    experts E ways and trade tokens by all-to-all; ``"ep_dp"`` is the ranks that hold the same
    experts (``dp * sp / E`` of them). It is a view of the same root mesh as the other axes, so an
    expert DTensor on ``"ep"`` composes with ``fully_shard`` over ``"ep_dp"``. Gradient contract
    (seqpar's loss scales each rank's share for an average over all ``dp * sp`` ranks,
    :mod:`seqpar.batch.loss`): a dense parameter's gradient is averaged over ``"dp_sp"``; an expert
    shard's gradient, which sums the shares of the ``E`` ranks that sent it tokens, must be summed
    over ``"ep_dp"`` and divided by ``dp * sp`` -- the average over ``"ep_dp"`` divided by ``E``.
    Raises ValueError for a mesh built without ``ep > 1``."""
    kept = _SUBMESHES.get(as_mesh(mesh, "ep_mesh")).get("ep_mesh")
    if kept is None:
        raise ValueError("this mesh has no expert parallelism: build it with seqpar.init_mesh(..., ep=E), E > 1 "
                         "dividing dp_shard x sp")
    return kept
