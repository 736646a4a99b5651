"""What every data source of ``seqpar train`` is, and what they all share.

A source holds *units*, read by index from its training split (``TRAIN``, in the run's data order)
or its held-out split (``EVAL``)::

    unit      a dict of ``[S]`` tensors (one row: a document, or a packed row of them), or of
              ``[k, S]`` tensors (k rows read together: a preference pair's chosen and rejected rows),
              or a latents sample (``[1, C, F, H, W]`` latents, ``[1, L, D]`` text, ``[1]`` noise seed)
    row(i)    unit i of the split; the training split is read in the seeded data order, so that
              resuming at a step reads the rows the uninterrupted run would have read

Every source -- files read into rows (:mod:`.data`), preference pairs (:mod:`.preference_data`),
the embedded demos (:mod:`.demo_data`) -- implements :class:`DataSource`; the objective decides what a
unit's loss is (:mod:`.objectives`), the source only what it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

TRAIN, EVAL = 0, 1
"""The two splits of every source."""

MODEL_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
"""A unit's columns the model reads (through :func:`seqpar.shard_batch`); any other column is an input
of the objective (RL rollouts' advantages and log-probs, KTO's labels)."""


class DataSource(Protocol):
    """The interface every ``seqpar train`` data source implements (see the module doc)."""

    @property
    def vocab_size(self) -> int:
        """Token ids the source's tokenizer (or task) can produce."""

    @property
    def max_token_id(self) -> int:
        """The largest token id the data holds (padding included)."""

    @property
    def chance(self) -> float | None:
        """The held-out accuracy of guessing, where the task defines one (None for text data)."""

    @property
    def n_eval(self) -> int:
        """Units in the held-out split."""

    @property
    def rows_per_unit(self) -> int:
        """Rows of ``--seq-len`` tokens in one unit (2 for a padded preference pair, else 1)."""

    def row(self, index: int, split: int = TRAIN) -> dict[str, Tensor]:
        """Unit ``index`` of ``split``."""

    def describe(self) -> str:
        """What the data is, in words."""


@dataclass
class TaskSource:
    """The source side of an embedded task (:mod:`.demo_data`): ``eval_rows`` held-out units, the
    task's vocabulary, every id of it possible; subclasses read a unit of the task."""

    task: Any
    eval_rows: int

    @property
    def vocab_size(self) -> int:
        return int(self.task.vocab_size)

    @property
    def max_token_id(self) -> int:
        return int(self.task.vocab_size) - 1

    @property
    def n_eval(self) -> int:
        return self.eval_rows

    def describe(self) -> str:
        return str(self.task.describe())


def rows_in(unit: dict[str, Tensor]) -> int:
    """The rows a unit holds: ``k`` for a unit of ``[k, S]`` tensors, else 1."""
    ids = unit["input_ids"]
    return int(ids.shape[0]) if ids.dim() == 2 else 1


def stack(units: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Units of ``[S]`` tensors (or ``[k, ...]``: a preference pair's two rows ``[2, S]``, a latents
    sample ``[1, C, F, H, W]``) -> a batch of ``[B, ...]`` tensors, in order (concatenated along the
    rows)."""
    return {k: torch.cat([u[k] if u[k].dim() > 1 else u[k][None] for u in units]) for k in units[0]}


def row_index(step: int, micro: int, dp_rank: int, b: int, *, grad_accum: int, dp: int, micro_batch: int) -> int:
    """Which unit of the run (counted from 0) dp rank ``dp_rank`` reads at ``(step, micro, b)``."""
    return ((step * grad_accum + micro) * dp + dp_rank) * micro_batch + b
