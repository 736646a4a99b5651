"""Counting collectives, for tests and for users who want to see what a step costs."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch.distributed as dist

from . import collectives

_NAMES = ["all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_gather_single",
          "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce", "broadcast", "batch_isend_irecv",
          "barrier"]
# Not isend/irecv: P2POp checks their identity, so wrapped ones would break batch_isend_irecv (which
# is counted itself, once per ring step).


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """Count calls to torch.distributed collectives (by name) inside the block::

        with count_collectives() as calls:
            out = ulysses_attention(...)
        assert calls["all_to_all_single"] == 2
    """
    calls: Counter = Counter()
    saved = {}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
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
        yield calls
    finally:
        for (where, name), fn in saved.items():
            setattr(dist if where == "dist" else collectives, name, fn)
