"""seqpar: exact sequence parallelism for PyTorch and HuggingFace transformers."""

from .collectives import (
    RingShift,
    all_to_all,
    all_to_all_multi,
    gather_seq,
    split_seq,
    split_sizes,
)
from .data import count_target_tokens, shard_batch
from .fsdp import apply_ddp, apply_fsdp
from .hf import parallelize, parallelized, unparallelize
from .hybrid import hybrid_attention, hybrid_groups
from .kernels import AttnSpec, MaskInfo, get_kernel
from .layout import inverse_permutation, layout_indices, layout_permutation
from .loss import gather_log_probs, sync_gradients
from .mesh import init_mesh
from .meta import SeqShard, gather_seq_shard
from .planner import Plan, plan
from .reference import reference_attention
from .ring import RingStats, ring_attention
from .ulysses import head_ranges, ulysses_attention

__version__ = "0.1.0"

__all__ = [
    "AttnSpec",
    "MaskInfo",
    "Plan",
    "RingShift",
    "RingStats",
    "SeqShard",
    "all_to_all",
    "all_to_all_multi",
    "apply_ddp",
    "apply_fsdp",
    "count_target_tokens",
    "gather_log_probs",
    "gather_seq",
    "gather_seq_shard",
    "get_kernel",
    "head_ranges",
    "hybrid_attention",
    "hybrid_groups",
    "init_mesh",
    "inverse_permutation",
    "layout_indices",
    "layout_permutation",
    "parallelize",
    "parallelized",
    "plan",
    "reference_attention",
    "ring_attention",
    "shard_batch",
    "split_seq",
    "split_sizes",
    "sync_gradients",
    "ulysses_attention",
    "unparallelize",
]
