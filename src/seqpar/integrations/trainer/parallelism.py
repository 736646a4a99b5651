"""accelerate's ``ParallelismConfig`` under :func:`seqpar.parallelize_trainer`: which seqpar mesh a
Trainer's ``TrainingArguments.parallelism_config`` and seqpar's ``sp`` make together.

accelerate counts every process in its config (``dp_replicate x dp_shard x tp x cp x sp`` must be
the number of processes), and its own cp / sp would shard the batch a second time, so they stay
refused. seqpar's sequence parallelism borrows its ranks from accelerate's ``dp_shard``: ``sp``
ranks that accelerate counts as data-parallel shards share one sequence instead of reading ``sp``
batches, as torchtitan's context parallelism borrows from its dp_shard (FSDP shards over
``dp_shard x cp``)::

    ParallelismConfig(dp_replicate_size=R, dp_shard_size=D, tp_size=T)  +  parallelize_trainer(sp=S)
      -> seqpar.init_mesh(dp_replicate=R, dp_shard=D // S, sp=S, tp=T)       (S must divide D)

With ``tp_size > 1`` accelerate leaves the model unwrapped (it checks the model's TP degree, which
seqpar records on the model, and wraps no DDP): the Trainer integration then averages the
gradients over ``dp x sp`` itself, once per optimizer step, before clipping
(:func:`seqpar.sync_gradients`). accelerate's FSDP2 and DeepSpeed shard over meshes of their own,
whose tp axis is not seqpar's: with ``tp_size > 1`` they are refused by name.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ... import compat
from ...attention.layout import inverse_permutation
from ...batch.local_batch import LocalBatch
from ...batch.vocab_parallel import vocab_range
from ...comm.gather import gather_seq
from ...comm.mesh import Axis, axis_group, tp_size
from ...errors import Refused


def trainer_mesh_kwargs(pc: Any, sp: int) -> dict[str, int]:
    """``seqpar.init_mesh`` keyword arguments for accelerate's ``ParallelismConfig`` ``pc`` (or None)
    and seqpar's ``sp`` (module doc): ``{"sp": sp}`` unless ``pc`` has ``tp_size > 1``. Pure. Raises
    ValueError when ``sp`` does not divide ``pc.dp_shard_size``."""
    tp = int(getattr(pc, "tp_size", 1) or 1) if pc is not None else 1
    if tp == 1:
        return {"sp": sp}
    shard = int(pc.dp_shard_size)
    if shard % sp:
        raise ValueError(f"sp={sp} must divide accelerate's dp_shard_size={shard}: seqpar's sequence parallelism "
                         f"borrows its ranks from dp_shard (ParallelismConfig(dp_shard_size={sp * max(1, shard // sp)}"
                         f", tp_size={tp}) for sp={sp})")
    return {"dp_replicate": int(pc.dp_replicate_size), "dp_shard": shard // sp, "sp": sp, "tp": tp}


def check_parallelism(trainer: Any, mesh: DeviceMesh) -> None:
    """Raise (the same on every rank, before any step) when accelerate's configuration cannot run
    with seqpar on ``mesh``: its own cp / sp, a tp degree other than the mesh's, or (at tp > 1)
    accelerate's FSDP / DeepSpeed or a TRL objective trainer."""
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and (getattr(pc, "cp_enabled", False) or getattr(pc, "sp_enabled", False)):
        raise ValueError("accelerate's parallelism_config enables context / sequence parallelism, which would shard "
                         "the batch a second time (and torch context_parallel drops the attention mask): remove "
                         "cp_size / sp_size from TrainingArguments.parallelism_config when seqpar runs the sequence "
                         "parallelism (dp_replicate_size, dp_shard_size and tp_size are fine)")
    tp = tp_size(mesh)
    want = int(getattr(pc, "tp_size", 1) or 1) if pc is not None else 1
    if tp != want:
        raise ValueError(f"the mesh has tp={tp} but accelerate's parallelism_config has tp_size={want}: build the mesh "
                         "with the same tp (or pass sp= and let parallelize_trainer build it)")
    if tp == 1:
        return
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        raise Refused(f"accelerate's {'FSDP' if trainer.is_fsdp_enabled else 'DeepSpeed'} with tp_size={tp} under "
                      "seqpar: it shards over accelerate's own mesh, whose tp axis is not the one seqpar split the "
                      "model over; train without it (seqpar averages the gradients over dp x sp itself), or in your "
                      "own loop with seqpar.apply_fsdp(model, mesh)")


def mark_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Tell transformers and accelerate the model is split over ``tp`` ranks (what they read: the
    model's ``tp_size``), so that accelerate's TP path takes it as it is, and the Trainer divides
    its batch count by it (:func:`seqpar.compat.set_tp_size`)."""
    compat.set_tp_size(model, tp)


def full_logits(logits: Tensor, batch: LocalBatch, mesh: DeviceMesh, model: nn.Module) -> Tensor:
    """``[B, S/sp, V(/tp)] -> [B, S, V]`` in the original token order, on every rank (evaluation: no
    autograd); at tp > 1 the vocabulary shards of ``model``'s head are gathered too."""
    tp = tp_size(mesh)
    if tp > 1:
        vocab = int(model.get_output_embeddings().out_features)
        sizes = [e - s for s, e in (vocab_range(vocab, tp, r) for r in range(tp))]
        logits = gather_seq(logits, dim=2, group=axis_group(mesh, Axis.TP.value), sizes=sizes, grad="slice")
    full = gather_seq(logits, dim=1, group=axis_group(mesh, Axis.SP.value), sizes=batch.shard.seq_lens,
                      grad="slice")
    if batch.shard.positions is not None:
        full = full.index_select(1, inverse_permutation(batch.shard.positions).to(full.device))
    return full
