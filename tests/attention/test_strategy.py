"""strategy="auto": hybrid on a ulysses x ring mesh, else Ulysses while every rank gets a query
head, else ring -- and parallelize(strategy="auto") records the choice."""

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from seqpar.attention.dispatch import resolve_strategy
from seqpar.comm.launch import run_distributed
from seqpar.integrations.state import state_of

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes


def _worker(rank, world):
    from seqpar.comm.mesh import init_mesh
    from seqpar.integrations.hf.parallelize import parallelize
    from seqpar.integrations.models import build_model

    flat, grid = init_mesh(sp=4), init_mesh(sp=4, ulysses=2, ring=2)
    out = {"flat 8 heads": resolve_strategy("auto", flat, 8), "flat 4 heads": resolve_strategy("auto", flat, 4),
           "flat 2 heads": resolve_strategy("auto", flat, 2), "grid": resolve_strategy("auto", grid, 2),
           "group 3 heads": resolve_strategy("auto", DeviceMesh.from_group(dist.group.WORLD, "cpu",
                                                                           mesh_dim_names=("sp",)), 3),
           "named": resolve_strategy("ring", flat, 8)}
    try:
        resolve_strategy("zigzag", flat, 8)
    except ValueError as e:
        out["bad"] = str(e)
    model, _ = build_model("tiny-llama", num_attention_heads=2, num_key_value_heads=1)
    parallelize(model, flat, strategy="auto")
    out["model"] = state_of(model).parallel.strategy
    return out


@pytest.fixture(scope="module")
def chosen():
    return run_distributed(_worker, 4, timeout=120)


def test_auto_strategy(chosen):
    for per_rank in chosen:
        assert per_rank["flat 8 heads"] == "ulysses"
        assert per_rank["flat 4 heads"] == "ulysses"
        assert per_rank["flat 2 heads"] == "ring"
        assert per_rank["grid"] == "hybrid"
        assert per_rank["group 3 heads"] == "ring"
        assert per_rank["named"] == "ring"
        assert "unknown strategy 'zigzag'" in per_rank["bad"] and "auto" in per_rank["bad"]
        assert per_rank["model"] == "ring"
