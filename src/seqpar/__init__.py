"""seqpar: exact sequence parallelism for PyTorch and HuggingFace transformers."""

from .collectives import (
    RingShift,
    all_to_all,
    all_to_all_multi,
    gather_seq,
    split_seq,
    split_sizes,
)
from .kernels import AttnSpec, MaskInfo, get_kernel
from .meta import SeqShard, gather_seq_shard
from .planner import Plan, plan
from .reference import reference_attention
from .ulysses import head_ranges, ulysses_attention

__version__ = "0.1.0"

__all__ = [
    "AttnSpec",
    "MaskInfo",
    "Plan",
    "RingShift",
    "SeqShard",
    "all_to_all",
    "all_to_all_multi",
    "gather_seq",
    "gather_seq_shard",
    "get_kernel",
    "head_ranges",
    "plan",
    "reference_attention",
    "split_seq",
    "split_sizes",
    "ulysses_attention",
]
