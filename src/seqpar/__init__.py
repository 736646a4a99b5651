"""seqpar: exact sequence parallelism for PyTorch and HuggingFace transformers.

The package is layered, lowest first (a module imports only its own layer or below; ``lint-imports``
checks it): ``comm`` (mesh, collectives, cross-rank agreement, local process launch), ``attention``
(spec and kernels, the float64 reference, layouts, Ulysses, ring, hybrid, dispatch), ``batch``
(shard_batch, targets, the exact loss), ``integrations`` (subpackages by what they integrate:
transformers models, VLMs, token mixers, the memory switches, FSDP2 / DDP, the Trainer, TRL) beside
``planner``, ``objectives`` (the training objectives and their seam), ``testing`` (parity engines),
``train``, ``bench``, and ``cli`` on top; below them all ``errors`` and ``compat`` (every private
torch / transformers / accelerate name seqpar touches).

What a user calls is listed in ``__all__``; everything else stays importable from its module.
"""

from .attention.dispatch import sp_attention
from .attention.hybrid import hybrid_attention
from .attention.reference import reference_attention
from .attention.ring import ring_attention
from .attention.shard import SeqShard
from .attention.ulysses import ulysses_attention
from .batch.loss import gather_log_probs, sync_gradients
from .batch.sharding import count_target_tokens, shard_batch
from .comm.collectives import all_to_all
from .comm.gather import gather_seq, split_seq
from .comm.mesh import init_mesh
from .errors import Refused
from .integrations.distributed.fsdp import apply_ddp, apply_fsdp
from .integrations.hf.export import save_pretrained
from .integrations.hf.parallelize import attention_kernel, parallelize, parallelized, unparallelize
from .integrations.memory.switches import memory_switches, reduce_memory, restore_memory, token_stats
from .integrations.moe.expert_parallel import apply_ep, remove_ep
from .integrations.trainer.mixin import SeqParTrainerMixin, parallelize_trainer
from .integrations.trl import registry as _trl_registry  # noqa: F401  classifies every TRL trainer
from .planner import Plan, plan

__version__ = "0.1.0"

__all__ = [
    "Plan",
    "Refused",
    "SeqParTrainerMixin",
    "SeqShard",
    "all_to_all",
    "apply_ddp",
    "apply_ep",
    "apply_fsdp",
    "attention_kernel",
    "count_target_tokens",
    "gather_log_probs",
    "gather_seq",
    "hybrid_attention",
    "init_mesh",
    "memory_switches",
    "parallelize",
    "parallelize_trainer",
    "parallelized",
    "plan",
    "reduce_memory",
    "reference_attention",
    "remove_ep",
    "restore_memory",
    "ring_attention",
    "save_pretrained",
    "shard_batch",
    "sp_attention",
    "split_seq",
    "sync_gradients",
    "token_stats",
    "ulysses_attention",
    "unparallelize",
]
