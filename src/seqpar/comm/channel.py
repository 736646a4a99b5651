"""The side channel of a job's faults: records in the store every rank of the process group reaches.

A collective cannot carry the news that a rank failed: the ranks waiting in it are waiting for that
rank. The process group's store can -- torchrun's agent store, the ``file://`` or ``env://``
rendezvous -- it lives outside the collectives and (torchrun, a file) outlives a failing process.
The layout, under the prefix ``seqpar/faults/``::

    count     how many records were published (the store's atomic add gives each one its number)
    f1, f2..  record n: a JSON :class:`Fault` -- rank, where, exception type, message, traceback,
              the batch (generation) it happened in, and its kind

A record is "raised" (an exception on that rank), "abandoned" (that rank left a collective
pending when it stopped, so the process group cannot be used again) or "lost" (ranks whose
processes are gone, found by a survivor from their beats: :mod:`.liveness`). Reading is one atomic add of 0
(the count) and, only when it grew, the new records.

**Resolved or not.** When *every* rank of the job raised in the same batch (a deterministic error:
the same bad option everywhere) no rank waits for another: nothing is pending and the job may go
on. Every other fault is unresolved -- some rank is, or will be, waiting for the failing one --
and every rank stops with the first unresolved raised record, the same on every rank::

    raised by ranks {0, 1, 2, 3} at batch 7, world 4, nothing abandoned  -> resolved
    raised by rank 1 at batch 7                                           -> unresolved: everyone stops
    ranks 2, 3 lost                                                       -> unresolved: everyone stops
    any "abandoned" record                                                -> nothing is resolved any more
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

PREFIX = "seqpar/faults/"
RAISED, ABANDONED, LOST = "raised", "abandoned", "lost"
_TEXT_LIMIT = 4000  # characters of a message or traceback kept in a record (a store value stays small)


@dataclass(frozen=True)
class Fault:
    """One record of the channel: ``rank`` (global) failed in ``where`` during batch ``generation``
    (the number of batches it had sharded) with ``error_type: message``; ``traceback`` is its
    Python traceback. ``kind``: ``"raised"``, ``"abandoned"`` (the rank left a collective pending)
    or ``"lost"`` (``lost``: the ranks whose processes are gone; ``rank``: the first of them;
    ``message`` says who noticed it where); ``bad_input``: the error was a ValueError. ``seq``: its
    number in the channel (1 = first)."""

    rank: int
    where: str
    error_type: str
    message: str
    traceback: str
    generation: int
    kind: str = RAISED
    bad_input: bool = False
    seq: int = 0
    ranks: tuple[int, ...] = ()  # the ranks that run the batch (its mesh); empty: every rank of the job
    lost: tuple[int, ...] = ()  # kind "lost": the ranks that are gone

    def describe(self) -> str:
        """``rank 1 failed in the forward (batch 7): RuntimeError: boom``, the same on every rank."""
        if self.kind == LOST:
            return self.message
        if self.kind == ABANDONED:
            return f"rank {self.rank} stopped waiting in {self.where} (batch {self.generation}): {self.message}"
        if not self.error_type:  # no exception: a step this rank did not take ("did not start ...")
            return f"rank {self.rank} {self.message}"
        return f"rank {self.rank} failed in {self.where} (batch {self.generation}): {self.error_type}: {self.message}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes, seq: int) -> Fault:
        data = json.loads(text)
        data["seq"] = seq
        data["ranks"] = tuple(data.get("ranks", ()))
        data["lost"] = tuple(data.get("lost", ()))
        return Fault(**data)


def clip(text: str) -> str:
    """``text`` cut to what a record keeps (its end: the last frames of a traceback matter most)."""
    return text if len(text) <= _TEXT_LIMIT else "...\n" + text[-_TEXT_LIMIT:]


class Channel:
    """The fault records of one process group (its store), as this process has read them so far.

    ``store``: any c10d Store every rank of the group reaches; ``world``: the group's size. Not
    thread-safe on its own: :mod:`seqpar.comm.faults` serializes the calls."""

    def __init__(self, store: Any, world: int) -> None:
        self.store = dist.PrefixStore(PREFIX, store)
        self.world = world
        self.records: list[Fault] = []

    def publish(self, fault: Fault) -> Fault:
        """Add ``fault`` as the next record; returns it with its number."""
        seq = int(self.store.add("count", 1))
        numbered = Fault(**{**asdict(fault), "seq": seq})
        self.store.set(f"f{seq}", numbered.to_json())
        return numbered

    def read(self, wait_s: float = 5.0) -> list[Fault]:
        """Every record published so far (one store round trip when none is new). A record whose
        number is out but whose text is not yet written is waited for, at most ``wait_s``."""
        count = int(self.store.add("count", 0))
        for seq in range(len(self.records) + 1, count + 1):
            key = f"f{seq}"
            try:
                self.store.wait([key], timedelta(seconds=wait_s))
            except Exception:  # its publisher died between the add and the set: nothing to read
                self.records.append(Fault(-1, "an unknown place", "unknown", "(the record was never written)", "",
                                          -1, seq=seq))
                continue
            self.records.append(Fault.from_json(self.store.get(key), seq))
        return self.records

    def first_unresolved(self) -> Fault | None:
        """The first record that stops the job (see the module doc), or None."""
        return first_unresolved(self.records, self.world)


def first_unresolved(records: list[Fault], world: int) -> Fault | None:
    """The first raised record that is not resolved (every rank that runs its batch -- ``ranks``, or
    all ``world`` -- raised in that batch, and nothing was abandoned) or lost record (never
    resolved); an abandoned record when that is all there is; None when every record is resolved.
    Pure: the rule itself, tested without a store."""
    if not records:
        return None
    abandoned = any(f.kind == ABANDONED for f in records)
    raised_by: dict[tuple[tuple[int, ...], int], set[int]] = {}
    for f in records:
        if f.kind == RAISED:
            raised_by.setdefault((f.ranks, f.generation), set()).add(f.rank)
    for f in records:
        if f.kind == LOST:
            return f
        if f.kind == RAISED and (abandoned or not set(f.ranks or range(world)) <= raised_by[f.ranks, f.generation]):
            return f
    return next((f for f in records if f.kind == ABANDONED), None)
