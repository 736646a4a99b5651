"""Counting collectives -- calls, and the bytes of their buffers -- for tests and for users who want
to see what a step costs."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from . import collectives

_NAMES = ["all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_gather_single",
          "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce", "broadcast", "batch_isend_irecv",
          "barrier"]
# Not isend/irecv: P2POp checks their identity, so wrapped ones would break batch_isend_irecv (which
# is counted itself, once per ring step).


def _bytes(args: tuple[Any, ...]) -> int:
    """The bytes of a call's largest buffer: an all-gather's output (every rank's piece), a
    reduce-scatter's input, an all-reduce's or broadcast's tensor, an all-to-all's input; for a
    batch of point-to-point ops, everything sent and received."""
    def size(t: Any) -> int:
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    if args and isinstance(args[0], list) and args[0] and isinstance(args[0][0], dist.P2POp):
        return sum(size(op.tensor) for op in args[0])
    return max((size(a) for a in args[:2]), default=0)


@contextlib.contextmanager
def _counting(record: Callable[[str, tuple[Any, ...]], None]) -> Iterator[None]:
    """Every torch.distributed collective (and seqpar's aliases of them) calls ``record(name, args)``."""
    saved = {}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            record(name, args)
            return fn(*args, **kwargs)
        return counted

    for name in _NAMES:
        if hasattr(dist, name):
            saved[("dist", name)] = getattr(dist, name)
            setattr(dist, name, wrap(name, saved[("dist", name)]))
    # seqpar binds version-portable aliases at import time
    for alias, name in (("all_gather_flat", "all_gather_flat"), ("reduce_scatter_flat", "reduce_scatter_flat")):
        saved[("seqpar", alias)] = getattr(collectives, alias)
        setattr(collectives, alias, wrap(name, saved[("seqpar", alias)]))
    try:
        yield
    finally:
        for (where, name), fn in saved.items():
            setattr(dist if where == "dist" else collectives, name, fn)


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count calls to torch.distributed collectives (by name) inside the block::

        with count_collectives() as calls:
            out = ulysses_attention(...)
        assert calls["all_to_all_single"] == 2
    """
    calls: Counter = Counter()

    def record(name: str, args: tuple[Any, ...]) -> None:
        calls[name] += 1

    with _counting(record):
        yield calls


@contextlib.contextmanager
def count_collective_bytes() -> Iterator[Counter]:
    """Sum, by collective name, the bytes of each call's largest buffer inside the block (an
    all-gather's output, a reduce-scatter's input, ...: :func:`_bytes`); a rank sends and receives
    at most that much in one call. ``calls["all_gather_flat"]`` after one sequence-parallel layer
    is what that layer gathered."""
    sizes: Counter = Counter()

    def record(name: str, args: tuple[Any, ...]) -> None:
        sizes[name] += _bytes(args)

    with _counting(record):
        yield sizes
