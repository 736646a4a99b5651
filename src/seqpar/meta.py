"""Batch-level facts about how the sequence is sharded, computed once per batch, used by every layer.

A :class:`SeqShard` says how long each rank's shard is, which global token sits at each position
of the layout (identity for a contiguous split, a permutation for zigzag), and which keys are
padding or belong to which packed document -- all in the *global* sequence. Attention layers read
it and issue no collective of their own for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .collectives import comm_device, split_offsets
from .validate import check_rows, gather_rows


@dataclass(frozen=True)
class SeqShard:
    """How the sequence is laid out over the ranks of one sequence-parallel group.

    seq_lens   local length on each rank; the global sequence (in layout order) is rank 0's
               shard, then rank 1's, ...
    positions  [S] long: the index in the original sequence of each layout position (None:
               identity, i.e. a contiguous split). Causal masks and windows compare these.
    key_keep   [B, S] bool in layout order, False marks padding (None: no padding).
    segments   [B, S] long in layout order, packed-document id of each token (None: one document).
    """

    seq_lens: tuple[int, ...]
    positions: Tensor | None = None
    key_keep: Tensor | None = None
    segments: Tensor | None = None

    @property
    def total(self) -> int:
        return sum(self.seq_lens)

    def local_range(self, rank: int) -> tuple[int, int]:
        return split_offsets(self.seq_lens)[rank], self.seq_lens[rank]

    def local_positions(self, rank: int, device: torch.device | None = None) -> Tensor:
        """[S_local] original index of each token this rank holds."""
        start, n = self.local_range(rank)
        if self.positions is not None:
            return self.positions[start:start + n]
        return torch.arange(start, start + n, device=device)


def gather_seq_shard(group: dist.ProcessGroup, *, local_len: int, batch_size: int,
                     key_padding_mask: Tensor | None = None, segment_ids: Tensor | None = None,
                     positions: Tensor | None = None, device: torch.device | None = None) -> SeqShard:
    """Build the :class:`SeqShard` of a batch from each rank's local pieces.

    ``key_padding_mask`` / ``segment_ids``: this rank's ``[B, S_local]`` (True / id per token);
    ``positions``: the whole ``[S]`` layout permutation (same on every rank) or None.
    Costs one metadata all-gather (lengths and flags, validated on every rank) plus, when a mask
    or segment ids are given, one all-gather of them together.
    """
    device = device or comm_device(group)
    fields = {
        "len": float(local_len), "batch": float(batch_size),
        "mask": 1.0 if key_padding_mask is not None else 0.0,
        "seg": 1.0 if segment_ids is not None else 0.0,
        "mask_ok": float(key_padding_mask is None or tuple(key_padding_mask.shape) == (batch_size, local_len)),
        "seg_ok": float(segment_ids is None or tuple(segment_ids.shape) == (batch_size, local_len)),
    }
    rows = gather_rows(fields, group, device)

    def local(r: int, row: dict[str, float]) -> str | None:
        if not row["mask_ok"]:
            return f"key padding mask must be [batch, local_seq_len] = [{int(row['batch'])}, {int(row['len'])}]"
        if not row["seg_ok"]:
            return f"segment ids must be [batch, local_seq_len] = [{int(row['batch'])}, {int(row['len'])}]"
        return None

    names = {"batch": "batch size", "mask": "whether a key padding mask is given",
             "seg": "whether segment ids (packed sequences) are given"}
    check_rows(rows, same=list(names), describe=lambda n: names[n], local=local, what="sequence shard")
    seq_lens = tuple(int(row["len"]) for row in rows)

    return with_global_masks(SeqShard(seq_lens, positions), key_padding_mask, segment_ids, group, device)


def with_global_masks(shard: SeqShard, key_padding_mask: Tensor | None, segment_ids: Tensor | None,
                      group: dist.ProcessGroup, device: torch.device | None = None) -> SeqShard:
    """``shard`` plus the global key mask and segment ids, from each rank's ``[B, S_local]`` pieces:
    one all-gather of both together (none when neither is given)."""
    if key_padding_mask is None and segment_ids is None:
        return shard
    from .collectives import _gather_padded

    pieces = [t.to(device=device or t.device, dtype=torch.int64) for t in (key_padding_mask, segment_ids)
              if t is not None]
    full = _gather_padded(torch.stack(pieces), 2, shard.seq_lens, group)  # [n, B, S]
    keep = full[0].bool() if key_padding_mask is not None else None
    seg = full[-1] if segment_ids is not None else None
    return SeqShard(shard.seq_lens, shard.positions, keep, seg)
