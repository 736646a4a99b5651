"""The device mesh seqpar runs on, with named axes, passed explicitly everywhere.

Axes (outermost first)::

    ("dp", "sp")                   strategy "ulysses" or "ring": sp ranks share one sequence
    ("dp", "ring", "ulysses")      strategy "hybrid": Ulysses inside a ulysses group (keep it
                                   inside a node), ring across; "sp" is their flattened product

A rank's sequence shard is its index along "sp" (ring-major for hybrid): the ulysses group of a
ring step holds consecutive shards, so its all-to-all yields one contiguous ring chunk.
"""

from __future__ import annotations

import weakref
from enum import Enum

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import compat


class Axis(str, Enum):
    DP = "dp"
    SP = "sp"
    ULYSSES = "ulysses"
    RING = "ring"


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


def init_mesh(*, sp: int, dp: int | None = None, ulysses: int | None = None, ring: int | None = None,
              device_type: str | None = None) -> DeviceMesh:
    """A ``dp x sp`` mesh over all ranks (``dp`` defaults to ``world // sp``).

    For a hybrid split give ``ulysses`` and ``ring`` with ``ulysses * ring == sp``: the mesh is
    ``dp x ring x ulysses`` and also carries the flattened ``sp`` axis. Raises ValueError (on every
    rank: the arguments are the same everywhere) if the sizes do not multiply to the world size.
    """
    if not dist.is_initialized():
        raise ValueError("init_mesh needs torch.distributed to be initialized (torchrun, or seqpar.comm.launch)")
    world = dist.get_world_size()
    if sp < 1 or world % sp:
        raise ValueError(f"sp={sp} must divide the world size {world}: choose sp in "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}")
    dp = world // sp if dp is None else dp
    if dp * sp != world:
        raise ValueError(f"dp={dp} x sp={sp} = {dp * sp} != world size {world}: set dp={world // sp} or omit it")
    device_type = device_type or default_device_type()
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


class _PerMesh:
    """Values kept beside a mesh for as long as the mesh lives, found by the mesh's identity; nothing
    is set on the DeviceMesh itself. Not a ``WeakKeyDictionary``: that compares keys with
    ``DeviceMesh.__eq__``, i.e. by contents, so two equal meshes (two ``init_mesh`` calls with the
    same sizes) would share one entry, and it would vanish with the first of them -- whenever the
    cyclic collector frees it, a moment that can differ between ranks, after which ring's dK/dV hops
    would run over different groups on different ranks. Not a dict keyed by ``id()`` either: an id
    is reused after its mesh is gone. A handful of meshes live in a process; a scan is enough."""

    def __init__(self) -> None:
        self._entries: list[tuple[weakref.ref[DeviceMesh], dict[str, dist.ProcessGroup]]] = []

    def set(self, mesh: DeviceMesh, value: dict[str, dist.ProcessGroup]) -> None:
        self._entries = [(ref, v) for ref, v in self._entries if ref() is not None and ref() is not mesh]
        self._entries.append((weakref.ref(mesh), value))

    def get(self, mesh: DeviceMesh) -> dict[str, dist.ProcessGroup]:
        return next((v for ref, v in self._entries if ref() is mesh), {})


_GRAD_GROUPS = _PerMesh()  # the companion groups of init_mesh's meshes, by mesh


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
    it as the flattened ``ring x ulysses``."""
    names = tuple(mesh.mesh_dim_names or ())
    if Axis.SP.value not in names and {Axis.RING.value, Axis.ULYSSES.value} <= set(names):
        names += (Axis.SP.value,)
    return names


def has_axis(mesh: DeviceMesh, axis: str) -> bool:
    return axis in axis_names(mesh)


def axis_group(mesh: DeviceMesh, axis: str) -> dist.ProcessGroup:
    """The process group of one mesh axis. Raises ValueError for a mesh without it."""
    mesh = as_mesh(mesh, f"the {axis!r} axis lookup")
    if not has_axis(mesh, axis):
        raise ValueError(f"the mesh has no {axis!r} axis (axes: {list(axis_names(mesh))}); build it with "
                         f"seqpar.init_mesh(sp=...{', ulysses=..., ring=...' if axis in ('ulysses', 'ring') else ''})")
    return mesh.get_group(axis)


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    """Size of an axis of ``mesh``. Raises ValueError for a mesh without it."""
    return dist.get_world_size(axis_group(mesh, axis))


def dp_size(mesh: DeviceMesh) -> int:
    """The data-parallel degree: the ``"dp"`` axis, or 1 for a mesh without one (sp ranks only)."""
    return axis_size(mesh, Axis.DP.value) if has_axis(mesh, Axis.DP.value) else 1
