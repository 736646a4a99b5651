"""LocalBatch: what one SP rank knows about the whole batch, and the keyword it travels under.

:func:`~seqpar.batch.sharding.shard_batch` builds it once per batch; the attention functions, the
loss and the model integrations read it from ``model(**local)``'s keyword arguments.
"""

from __future__ import annotations

from torch import Tensor

from ..attention.shard import SeqShard
from .visual import VisualBatch

BATCH_KWARG = "seqpar_batch"
"""The key under which a sharded batch carries its :class:`LocalBatch` into ``model(**local)``."""


class LocalBatch:
    """What one SP rank knows about the whole batch, computed once by :func:`~seqpar.batch.sharding.shard_batch`.

    Travels to the attention function and the loss through ``model(**local)`` keyword arguments.
    A plain class (not a dataclass) so that DDP / FSDP input movers pass it through untouched.

    shard         the :class:`SeqShard` (lengths, layout permutation, global key mask, segments; the
                  batch's plans and failure record live in its state)
    sp_rank       this rank's index in the SP group; sp_size its size; dp_size the data-parallel size
    denominator   N of the loss: ``num_items_in_batch`` if given, else the (weighted) target count
                  of this dp rank's whole batch
    grad_scale    d(out.loss)/d(local sum of token losses): ``dp_size * sp_size / N`` with
                  ``num_items_in_batch`` (N counts every dp rank), else ``sp_size / N`` (N: this dp
                  rank's targets) -- so that the *average* over the dp x sp ranks that DDP / FSDP2 /
                  :func:`seqpar.sync_gradients` take is the exact gradient (see :mod:`seqpar.batch.loss`);
                  ``grad_ranks / N`` when given (a dynamic schedule's bin on a sub-group: the average
                  runs over every rank of the job, :mod:`seqpar.planner.bins`)
    loss_weights  [B, S_local] per-target weights (shifted with the labels) or None
    visual        the whole batch's images / video (:class:`~seqpar.batch.visual.VisualBatch`) or None
    token_types   ``[B, S]`` the whole rows' ``token_type_ids`` (original order) or None: the model's
                  family turns them into the shard's bidirectional span ids before its first layer
                  (:func:`seqpar.integrations.vlm.spans.with_spans`)
    positions_given  whether the batch brought its own position_ids (else shard_batch made 0..S-1)
    grad_ranks    the job's rank count W for a dynamic schedule's bin (None otherwise); ``in_bin``
                  then holds: other rows of the step run in other forwards
    """

    __slots__ = ("shard", "sp_rank", "sp_size", "dp_size", "denominator", "grad_scale", "num_items_in_batch",
                 "loss_weights", "attention_calls", "visual", "token_types", "positions_given", "grad_ranks")

    def __init__(self, shard: SeqShard, *, sp_rank: int, sp_size: int, dp_size: int, denominator: float,
                 num_items_in_batch: float | None, loss_weights: Tensor | None, grad_ranks: int | None = None) -> None:
        self.shard = shard
        self.sp_rank, self.sp_size, self.dp_size = sp_rank, sp_size, dp_size
        self.num_items_in_batch = num_items_in_batch
        self.denominator = denominator
        n = float(denominator) if denominator > 0 else 1.0  # no target at all: the loss is 0, not NaN
        # the ranks' gradients are averaged afterwards: each rank's share is scaled by how many
        # ranks the average divides by (all dp x sp with a global N; sp alone with a per-dp-rank
        # N, whose dp average is then the mean of the dp ranks' means)
        ranks = sp_size * dp_size if num_items_in_batch is not None else sp_size
        ranks = grad_ranks if grad_ranks is not None else ranks  # a dynamic schedule's bin: every rank
        self.grad_ranks = grad_ranks
        self.grad_scale = ranks / n
        self.loss_weights = loss_weights
        self.attention_calls = 0  # how many attention layers read this batch (checked by the loss)
        self.visual: VisualBatch | None = None  # set by shard_batch for a batch with images
        self.token_types: Tensor | None = None  # set by shard_batch for a batch with token_type_ids
        self.positions_given = False

    @property
    def in_bin(self) -> bool:
        """The batch is one bin of a dynamic schedule's step (``grad_ranks`` given): other rows of the
        step run in other forwards, at any degree, the job's sp included."""
        return self.grad_ranks is not None

    @property
    def local_len(self) -> int:
        return self.shard.seq_lens[self.sp_rank]

    def __repr__(self) -> str:
        return (f"LocalBatch(seq_lens={self.shard.seq_lens}, sp_rank={self.sp_rank}, denominator={self.denominator:g},"
                f" layout={'contiguous' if self.shard.positions is None else 'permuted'})")
