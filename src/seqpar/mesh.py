"""The device mesh seqpar runs on, with named axes, passed explicitly everywhere.

Axes (outermost first)::

    ("dp", "sp")                   strategy "ulysses" or "ring": sp ranks share one sequence
    ("dp", "ring", "ulysses")      strategy "hybrid": Ulysses inside a ulysses group (keep it
                                   inside a node), ring across; "sp" is their flattened product

A rank's sequence shard is its index along "sp" (ring-major for hybrid): the ulysses group of a
ring step holds consecutive shards, so its all-to-all yields one contiguous ring chunk.
"""

from __future__ import annotations

from enum import Enum

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class Axis(str, Enum):
    DP = "dp"
    SP = "sp"
    ULYSSES = "ulysses"
    RING = "ring"


MeshOrGroup = DeviceMesh | dist.ProcessGroup


def _default_device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"


def init_mesh(*, sp: int, dp: int | None = None, ulysses: int | None = None, ring: int | None = None,
              device_type: str | None = None) -> DeviceMesh:
    """A ``dp x sp`` mesh over all ranks (``dp`` defaults to ``world // sp``).

    For a hybrid split give ``ulysses`` and ``ring`` with ``ulysses * ring == sp``: the mesh is
    ``dp x ring x ulysses`` and also carries the flattened ``sp`` axis. Raises ValueError (on every
    rank: the arguments are the same everywhere) if the sizes do not multiply to the world size.
    """
    if not dist.is_initialized():
        raise ValueError("init_mesh needs torch.distributed to be initialized (torchrun, or seqpar.launch)")
    world = dist.get_world_size()
    if sp < 1 or world % sp:
        raise ValueError(f"sp={sp} must divide the world size {world}: choose sp in "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}")
    dp = world // sp if dp is None else dp
    if dp * sp != world:
        raise ValueError(f"dp={dp} x sp={sp} = {dp * sp} != world size {world}: set dp={world // sp} or omit it")
    device_type = device_type or _default_device_type()
    if ulysses is None and ring is None:
        return init_device_mesh(device_type, (dp, sp), mesh_dim_names=(Axis.DP.value, Axis.SP.value))
    ulysses = ulysses if ulysses is not None else sp // (ring or 1)
    ring = ring if ring is not None else sp // ulysses
    if ulysses * ring != sp:
        raise ValueError(f"ulysses={ulysses} x ring={ring} = {ulysses * ring} != sp={sp}")
    mesh = init_device_mesh(device_type, (dp, ring, ulysses),
                            mesh_dim_names=(Axis.DP.value, Axis.RING.value, Axis.ULYSSES.value))
    mesh[(Axis.RING.value, Axis.ULYSSES.value)]._flatten(Axis.SP.value)
    return mesh


def axis_group(mesh: MeshOrGroup, axis: str) -> dist.ProcessGroup:
    """The process group of one mesh axis. A bare ProcessGroup stands for the "sp" axis."""
    if isinstance(mesh, dist.ProcessGroup):
        if axis != Axis.SP.value:
            raise ValueError(f"a process group only provides the 'sp' axis; pass a DeviceMesh with a {axis!r} axis")
        return mesh
    names = mesh.mesh_dim_names or ()
    try:
        return mesh.get_group(axis)
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(f"the mesh has no {axis!r} axis (axes: {list(names)}); build it with seqpar.init_mesh"
                         f"(sp=...{', ulysses=..., ring=...' if axis in ('ulysses', 'ring') else ''})") from e


def axis_size(mesh: MeshOrGroup, axis: str) -> int:
    """Size of an axis (1 when a DeviceMesh lacks it, e.g. "dp" of a bare group)."""
    if isinstance(mesh, dist.ProcessGroup):
        return dist.get_world_size(mesh) if axis == Axis.SP.value else 1
    try:
        return dist.get_world_size(mesh.get_group(axis))
    except (KeyError, RuntimeError, ValueError):
        return 1


def has_axis(mesh: MeshOrGroup, axis: str) -> bool:
    if isinstance(mesh, dist.ProcessGroup):
        return axis == Axis.SP.value
    try:
        mesh.get_group(axis)
        return True
    except (KeyError, RuntimeError, ValueError):
        return False
