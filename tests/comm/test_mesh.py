"""The mesh's companion groups (ring's dK/dV hops) live beside the mesh, found by its identity:
nothing is set on the DeviceMesh, and two equal meshes (``DeviceMesh.__eq__`` compares contents)
keep groups of their own, which do not vanish when the other mesh is collected."""

import gc

import pytest
import torch.distributed as dist

from seqpar.comm.launch import run_distributed
from seqpar.comm.mesh import Axis, _PerMesh, axis_group, grad_group, init_mesh


class _Equal:
    """A key that equals every other and hashes alike, as two DeviceMesh of the same shape do."""

    def __eq__(self, other):
        return isinstance(other, _Equal)

    def __hash__(self):
        return 1


def test_per_mesh_entries_are_by_identity_and_die_with_their_key():
    table = _PerMesh()
    a, b = _Equal(), _Equal()
    table.set(a, {"sp": "groups of a"})
    table.set(b, {"sp": "groups of b"})
    assert a == b and table.get(a) == {"sp": "groups of a"} and table.get(b) == {"sp": "groups of b"}
    del a
    gc.collect()
    assert table.get(b) == {"sp": "groups of b"}  # b's entry outlives an equal key
    table.set(b, {"sp": "again"})
    assert table.get(b) == {"sp": "again"} and len(table._entries) == 1  # replaced; the dead entry pruned
    assert table.get(_Equal()) == {}


def _worker(rank, world):
    first = init_mesh(sp=world, device_type="cpu")
    second = init_mesh(sp=world, device_type="cpu")
    out = {"equal": first == second, "attributes": sorted(a for a in vars(first) if a.startswith("_seqpar"))}
    g1, g2 = grad_group(first, Axis.SP.value), grad_group(second, Axis.SP.value)
    out["own groups"] = g1 is not None and g2 is not None and g1 is not g2
    out["ranks"] = dist.get_process_group_ranks(g2) == dist.get_process_group_ranks(axis_group(second, "sp"))
    del first, g1
    gc.collect()
    out["after the first is gone"] = grad_group(second, Axis.SP.value) is g2
    return out


@pytest.mark.distributed
def test_two_equal_meshes_keep_their_own_grad_groups():
    for r in run_distributed(_worker, 2, timeout=120):
        assert r == {"equal": True, "attributes": [], "own groups": True, "ranks": True,
                     "after the first is gone": True}, r
