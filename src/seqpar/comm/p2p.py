"""Point-to-point transfers around a ring of ranks (ring attention's K/V and dK/dV hops)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import waits
from .collectives import Group


class RingShift:
    """Send tensors to the next rank and receive the previous rank's, asynchronously.

    ``start(tensors)`` posts the transfers and returns at once; ``wait()`` returns the received
    tensors. Compute placed between the two overlaps the transfer. ``shift=-1`` reverses the ring.
    """

    def __init__(self, group: Group, shift: int = 1) -> None:
        self.group = group
        self.p, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.dst = dist.get_global_rank(group, (self.rank + shift) % self.p)
        self.src = dist.get_global_rank(group, (self.rank - shift) % self.p)
        self._reqs: list = []
        self._bufs: list[Tensor] = []

    def start(self, tensors: Sequence[Tensor], into: Sequence[Tensor] | None = None) -> None:
        """Post the transfers; the previous rank's tensors land in ``into`` (buffers shaped like
        ``tensors``, reused across steps by the caller: none is allocated here) or in new ones."""
        assert not self._reqs, "wait() for the previous transfer first"
        self._bufs = list(into) if into is not None else [torch.empty_like(t) for t in tensors]
        ops = []
        for t, buf in zip(tensors, self._bufs, strict=True):
            ops.append(dist.P2POp(dist.isend, t.contiguous(), self.dst, group=self.group))
            ops.append(dist.P2POp(dist.irecv, buf, self.src, group=self.group))
        self._reqs = dist.batch_isend_irecv(ops) if self.p > 1 else []
        if self.p == 1:
            self._bufs = [t for t in tensors]

    def wait(self) -> list[Tensor]:
        if self._reqs:
            waits.wait_requests(self._reqs, self._bufs[0].device, "a ring step")
        self._reqs = []
        return self._bufs
