"""Layer 0: seqpar's own exception types (imports nothing of seqpar).

A user error is a ``ValueError`` (the input or an option is wrong: change it). A *refusal* is the
subset that says "seqpar will not run this exactly, by design": a model, layer, mask or option
whose sharded result would not equal the unsharded one. It is raised as :class:`Refused`, so a
test or the zoo can tell a deliberate refusal from an accident (an incidental ``ValueError`` from
torch or transformers is a bug, not a refusal).
"""

from __future__ import annotations


class Refused(ValueError):
    """seqpar refuses this model, layer, mask or option because it cannot run it exactly under
    sequence parallelism; the message names the mechanism and what to change. A ``ValueError``, so
    code that catches user errors keeps catching it."""


class RankFailed(RuntimeError):
    """Another rank of the job failed (``fault``: who, where, its exception and traceback), so this
    rank stops too: raised on every rank but the failing one, with the same message everywhere
    (:mod:`seqpar.comm.faults`). :class:`RankFailedBadInput` when the failing rank's error was a
    ``ValueError`` (bad input stays bad input on every rank)."""

    def __init__(self, message: str, fault: object = None) -> None:
        super().__init__(message)
        self.fault = fault


class RankFailedBadInput(RankFailed, ValueError):
    """:class:`RankFailed` for a failing rank's ``ValueError``."""


class FeatureUnavailable(UserWarning):
    """A seqpar feature is unavailable on the installed versions (an outside internal it reaches
    into moved): the model still runs exactly, in a fallback the message names with its cost. Given
    once, at ``parallelize``, on rank 0 (:func:`seqpar.integrations.hf.features.feature_report` lists
    every feature and why)."""


class TargetsLeftOut(UserWarning):
    """seqpar's loss leaves out targets that transformers' own loss counts: in a left-padded row, the
    first real token, which the padding position before it would predict (seqpar: a padding position
    predicts nothing, :mod:`seqpar.batch.targets`). Given once per process, on rank 0, by
    :func:`seqpar.shard_batch`, with the count in the first batch that had any."""
