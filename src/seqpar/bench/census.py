"""What a step's memory peak is made of: :class:`PeakCensus`, a live-tensor probe that also keeps,
at its peak, every live storage's maker (the aten op), shape and dtype, and :func:`attribute`,
which sorts those bytes into kinds by shape and maker (gradients, logits tiles, MLP tiles,
communication buffers, hidden states, attention)::

    census at the peak            kind (first rule that matches)
    (op, shape, dtype) -> bytes   c10d op (all_to_all, all_gather, ...),  communication buffers
                                  or a flat 1-D cat (a gradient bucket)
                                  a parameter's shape and dtype           gradients
                                  last dim = vocabulary                   logits tiles
                                  last dim = MLP width                    MLP tiles
                                  last dim = hidden                       hidden states (layer inputs kept
                                                                          for checkpoints, residuals, norms)
                                  anything else                           attention and the rest (q/k/v,
                                                                          the kernel's out and lse, their
                                                                          gradients; an all-to-all's output
                                                                          where its buffer was made by
                                                                          new_empty, as seqpar's)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from ..testing.memory import LiveMemory

COMM_OPS = ("all_to_all", "alltoall", "all_gather", "allgather", "reduce_scatter", "allreduce", "all_reduce",
            "broadcast", "recv_", "send")
KINDS = ("gradients", "logits tiles", "MLP tiles", "communication buffers", "hidden states",
         "attention and the rest")


class PeakCensus(LiveMemory):
    """:class:`~seqpar.testing.memory.LiveMemory` that also records what is alive at its peak:
    ``census`` maps ``(op, shape, dtype)`` to bytes, taken whenever the peak grows by ``grain`` of
    itself (1%: a census within 1% of the exact peak, at a few hundred snapshots per step)."""

    def __init__(self, grain: float = 0.01) -> None:
        super().__init__()
        self.grain = grain
        self.census: dict[tuple[str, tuple[int, ...], str], int] = {}
        self._meta: dict[int, tuple[str, tuple[int, ...], str]] = {}
        self._taken = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = getattr(getattr(func, "overloadpacket", func), "__name__", str(func))
        with self._lock:
            for t in _outputs(out):
                key = id(t.untyped_storage())
                if key in self._sizes and key not in self._meta:
                    self._meta[key] = (name, tuple(t.shape), str(t.dtype).replace("torch.", ""))
            if self.live_bytes >= self.peak_bytes and self.live_bytes > self._taken * (1 + self.grain):
                self._snapshot()
        return out

    def _snapshot(self) -> None:
        census: dict[tuple[str, tuple[int, ...], str], int] = defaultdict(int)
        for key, n in self._sizes.items():
            census[self._meta.get(key, ("?", (), "?"))] += n
        self.census, self._taken = dict(census), self.live_bytes

    def _dead(self, key: int) -> None:
        super()._dead(key)
        self._meta.pop(key, None)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._meta.clear()


def _outputs(out: Any) -> Iterable[torch.Tensor]:
    for x in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(x, torch.Tensor) and x.layout == torch.strided and x.device.type != "meta":
            yield x
        elif isinstance(x, (tuple, list)):
            yield from _outputs(x)


def attribute(census: dict[tuple[str, tuple[int, ...], str], int], *, vocab: int, hidden: int, mlp: int,
              param_shapes: Iterable[tuple[tuple[int, ...], str]]) -> dict[str, int]:
    """Bytes of a census by kind (:data:`KINDS`, rules in the module doc). ``param_shapes``: every
    parameter's ``(shape, dtype)`` (dtype as ``str(dtype)`` without ``torch.``)."""
    params = set(param_shapes)
    out = dict.fromkeys(KINDS, 0)
    for (op, shape, dtype), n in census.items():
        last = shape[-1] if shape else 0
        if any(c in op for c in COMM_OPS) or (op == "cat" and len(shape) == 1):
            kind = "communication buffers"
        elif (shape, dtype) in params:
            kind = "gradients"
        elif last == vocab:
            kind = "logits tiles"
        elif last == mlp:
            kind = "MLP tiles"
        elif last == hidden:
            kind = "hidden states"
        else:
            kind = "attention and the rest"
        out[kind] += n
    return out
