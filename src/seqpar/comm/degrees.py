"""The sub-meshes a dynamic SP schedule runs its bins on, created once per job mesh.

For every degree ``k`` of the chain ``1, 2, 4, ..., sp`` the ranks of the job's ``dp x sp`` mesh
(in mesh order, sp innermost) are cut into aligned blocks of ``k``; this rank's block is a 1-D
mesh with one ``"sp"`` axis. Building them is collective: every rank creates every block's group,
degree by degree, in the same order (``DeviceMesh`` does it for a ``[W/k, k]`` rank grid). A bin's
batch is sharded over its block (``shard_batch(batch, degrees.mesh(k))``) and a model
parallelized over the job mesh runs it there (:func:`degree_meshes_of` is how it finds out)::

    job mesh (dp=1, sp=4)   ranks [0 1 2 3]
    degree 2 meshes         [0 1] [2 3]         rank 2's mesh(2): sp group {2, 3}
    degree 1 meshes         [0] [1] [2] [3]     no exchange at all
"""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import Refused
from .mesh import Axis, as_mesh, axis_names, axis_size, has_axis


def degree_chain(sp: int) -> tuple[int, ...]:
    """``1, 2, 4, ...`` (powers of two dividing ``sp``), then ``sp``: each divides the next."""
    if not isinstance(sp, int) or sp < 1:
        raise ValueError(f"sp must be a positive integer, got {sp!r}")
    chain, k = [], 1
    while k <= sp and sp % k == 0:
        chain.append(k)
        k *= 2
    return tuple(chain) if chain[-1] == sp else (*chain, sp)


class DegreeMeshes:
    """This rank's block mesh for each degree of the chain over ``mesh`` (see the module doc)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        mesh = as_mesh(mesh, "DegreeMeshes")
        if {Axis.ULYSSES.value, Axis.RING.value} & set(axis_names(mesh)):
            raise Refused("a dynamic SP schedule runs over a dp x sp mesh (strategy 'ulysses' or 'ring'); the "
                          "hybrid mesh's ulysses x ring split has no sub-degree here: use seqpar.init_mesh(sp=...)")
        if has_axis(mesh, Axis.TP.value) and axis_size(mesh, Axis.TP.value) > 1:
            raise Refused(f"a dynamic SP schedule with tensor parallelism (tp={axis_size(mesh, Axis.TP.value)}) is "
                          "not supported: its bins re-cut the sp ranks, which would split a tp group's batch; use a "
                          "static schedule, or tp=1")
        self._parent = weakref.ref(mesh)  # the registry keeps this object as long as the mesh lives
        self.sp = axis_size(mesh, Axis.SP.value)
        self.degrees = degree_chain(self.sp)
        ranks = mesh.mesh.flatten()
        self._grids: dict[int, DeviceMesh] = {}
        self._meshes: dict[int, DeviceMesh] = {}
        for k in self.degrees:
            grid = DeviceMesh(mesh.device_type, ranks.reshape(-1, k), mesh_dim_names=("blocks", Axis.SP.value))
            self._grids[k] = grid  # keeps the 1-D view's root alive
            self._meshes[k] = mesh if k == self.sp and ranks.numel() == k else grid[Axis.SP.value]
        everyone = DeviceMesh(mesh.device_type, ranks.reshape(1, -1), mesh_dim_names=("one", "all"))
        self._grids[0] = everyone
        self.world = int(ranks.numel())
        # every rank of the job: the schedule's agreement and the step's loss
        self.all_group: dist.ProcessGroup = everyone.get_group("all")
        _REGISTRY.append((weakref.ref(mesh), self))

    @property
    def parent(self) -> DeviceMesh | None:
        return self._parent()

    def mesh(self, degree: int) -> DeviceMesh:
        """This rank's block of ``degree`` ranks, as a 1-D ``"sp"`` mesh. Raises ValueError for a
        degree outside the chain."""
        if degree not in self._meshes:
            raise ValueError(f"degree {degree} is not one of {list(self.degrees)} (sp={self.sp})")
        return self._meshes[degree]

    def degree_of(self, mesh: DeviceMesh) -> int | None:
        """The degree whose block mesh ``mesh`` is (by identity), or None."""
        return next((k for k, m in self._meshes.items() if m is mesh), None)


_REGISTRY: list[tuple[weakref.ref[DeviceMesh], DegreeMeshes]] = []
"""(job mesh, its DegreeMeshes) pairs, by the mesh's identity (see ``mesh._PerMesh`` for why not a
dict); an entry goes with its mesh."""


def _live() -> list[tuple[weakref.ref[DeviceMesh], DegreeMeshes]]:
    _REGISTRY[:] = [(m, d) for m, d in _REGISTRY if m() is not None]
    return _REGISTRY


def degree_meshes(mesh: DeviceMesh) -> DegreeMeshes:
    """The :class:`DegreeMeshes` of ``mesh``, built on first use (collective: every rank asks for it
    at the same point, so every rank builds, or reuses, alike)."""
    return degree_meshes_of(mesh) or DegreeMeshes(mesh)


def degree_meshes_of(mesh: DeviceMesh) -> DegreeMeshes | None:
    """The :class:`DegreeMeshes` built over ``mesh`` (by identity), or None."""
    return next((d for m, d in _live() if m() is mesh), None)


def is_block_of(job_mesh: DeviceMesh, mesh: DeviceMesh) -> bool:
    """Whether ``mesh`` is one of the block meshes built over ``job_mesh``."""
    found = degree_meshes_of(job_mesh)
    return found is not None and found.degree_of(mesh) is not None
