"""Which parallel dimensions the installed torch and accelerate leave available (rows of
``seqpar env``): the N-D mesh (its flattened and unflattened views), tensor parallelism (torch's
DTensor styles), expert parallelism's place on the mesh, accelerate's ``ParallelismConfig``."""

from __future__ import annotations

import importlib

from ...compat import FeatureStatus


def _has(module: str, *names: str) -> bool:
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False
    return all(hasattr(mod, n) for n in names)


def parallelism_report() -> list[FeatureStatus]:
    """One row per dimension of :func:`seqpar.init_mesh`: available here, how, or why not."""
    from torch.distributed.device_mesh import DeviceMesh

    views = hasattr(DeviceMesh, "_flatten") and hasattr(DeviceMesh, "_unflatten")
    tp = _has("torch.distributed.tensor.parallel", "parallelize_module", "ColwiseParallel", "RowwiseParallel",
              "PrepareModuleInputOutput")
    accel = _has("accelerate", "ParallelismConfig")
    return [
        FeatureStatus("parallelism: dp x sp (ulysses, ring, hybrid)", True,
                      "init_mesh(sp=, dp=, ulysses=, ring=); FSDP2 / DDP over dp x sp, or sync_gradients"),
        FeatureStatus("parallelism: N-D mesh (dp_replicate x dp_shard x sp x tp)", views,
                      "init_mesh(dp_replicate=, dp_shard=, sp=, tp=): tp innermost, dp outermost" if views else
                      "this torch's DeviceMesh has no _flatten / _unflatten: only the dp x sp mesh"),
        FeatureStatus("parallelism: tp", tp and views,
                      "the model's transformers tp_plan with torch's DTensor styles; vocabulary-parallel head and "
                      "loss; Ulysses splits each tp rank's heads over sp" if tp else
                      "torch.distributed.tensor.parallel lacks the styles seqpar maps (torch >= 2.5)"),
        FeatureStatus("parallelism: ep (mesh)", views,
                      "init_mesh(ep=) folds ep over dp_shard x sp: seqpar.comm.mesh.ep_mesh gives ('ep_dp', 'ep')"),
        FeatureStatus("parallelism: accelerate ParallelismConfig", accel,
                      "dp_replicate_size / dp_shard_size / tp_size with parallelize_trainer(sp=): sp borrows "
                      "dp_shard's ranks; cp_size / sp_size refused" if accel else
                      "accelerate has no ParallelismConfig"),
    ]
