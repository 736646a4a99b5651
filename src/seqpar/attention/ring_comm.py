"""How K/V blocks travel around the ring: small swappable objects behind one interface.

``comm.blocks(k, v)`` yields ``(owner, k_block, v_block)`` for ring steps ``t = 0..P-1`` (at step t
the block of rank ``(rank - t) % P``); compute placed between two yields overlaps the transfer.
``comm.grad_sink()`` takes the dK/dV of each yielded block in the same order (``push``) and returns
this rank's own dK/dV summed over all ranks (``result``). Blocks have the same shape on every rank
(the ring pads them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import collectives
from ..comm.p2p import RingShift


class GradSink(ABC):
    """Takes each yielded block's dK/dV in ring order; returns this rank's own, summed over ranks."""

    @abstractmethod
    def push(self, dk: Tensor, dv: Tensor) -> None: ...

    @abstractmethod
    def result(self) -> tuple[Tensor, Tensor]: ...


class RingComm(ABC):
    """How K/V blocks travel (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.p, self.rank = group, dist.get_world_size(group), dist.get_rank(group)

    @abstractmethod
    def blocks(self, k: Tensor, v: Tensor) -> Iterator[tuple[int, Tensor, Tensor]]: ...

    @abstractmethod
    def grad_sink(self) -> GradSink: ...


class P2PComm(RingComm):
    """K/V move one hop per step (batch_isend_irecv); dK/dV accumulators follow one step behind."""

    def blocks(self, k: Tensor, v: Tensor) -> Iterator[tuple[int, Tensor, Tensor]]:
        """Yield ``(owner, k, v)`` for t = 0..P-1; the caller's compute between yields overlaps the
        transfer of the next block."""
        shift, cur = RingShift(self.group), (k, v)  # [B, H_kv, L, D] each, L the longest shard
        for t in range(self.p):
            if t < self.p - 1:
                shift.start(cur)
            yield (self.rank - t) % self.p, cur[0], cur[1]
            if t < self.p - 1:
                cur = tuple(shift.wait())

    def grad_sink(self) -> _P2PGrads:
        return _P2PGrads(self.group, self.p)


class _P2PGrads(GradSink):
    """Step t: add this rank's dK/dV of the block it holds to the accumulator that arrived with it
    and pass it on; after P steps each accumulator has visited every rank and is back home."""

    def __init__(self, group: dist.ProcessGroup, p: int) -> None:
        self.shift, self.p, self.t = RingShift(group), p, 0

    def push(self, dk: Tensor, dv: Tensor) -> None:
        if self.t > 0:
            acc_k, acc_v = self.shift.wait()
            dk, dv = acc_k.add_(dk), acc_v.add_(dv)
        self.shift.start([dk, dv])  # [B, H_kv, L, D] float32 (float64) partial sums
        self.t += 1

    def result(self) -> tuple[Tensor, Tensor]:
        dk, dv = self.shift.wait()
        return dk, dv


class AllGatherComm(RingComm):
    """K/V gathered once (all P blocks held at a time); dK/dV of every block reduce-scattered back."""

    def blocks(self, k: Tensor, v: Tensor) -> Iterator[tuple[int, Tensor, Tensor]]:
        if k.shape == v.shape:  # one collective for both
            kv = self._gather(torch.stack([k, v]))  # [P, 2, B, H_kv, L, D]
            ks, vs = kv[:, 0], kv[:, 1]
        else:
            ks, vs = self._gather(k), self._gather(v)  # [P, B, H_kv, L, D]
        for t in range(self.p):
            src = (self.rank - t) % self.p
            yield src, ks[src], vs[src]

    def _gather(self, x: Tensor) -> Tensor:
        """All-gather: ``x -> [P, *x.shape]``; its transpose is the reduce-scatter in ``_AllGatherGrads``."""
        if self.p == 1:
            return x[None]
        buf = x.new_empty((self.p, *x.shape))
        collectives.all_gather_flat(buf.view(-1, *x.shape[1:]), x.contiguous(), group=self.group)
        return buf

    def _reduce_scatter(self, full: Tensor) -> Tensor:
        """``[P, *shape] -> [*shape]``: the sum over ranks of slot ``rank``."""
        if self.p == 1:
            return full[0]
        out = full.new_empty(full.shape[1:])
        collectives.reduce_scatter_flat(out, full.view(-1, *full.shape[2:]), group=self.group)
        return out

    def grad_sink(self) -> _AllGatherGrads:
        return _AllGatherGrads(self)


class _AllGatherGrads(GradSink):
    """Collect every block's dK/dV, then reduce-scatter once: block r's sum over ranks lands on rank r."""

    def __init__(self, comm: AllGatherComm) -> None:
        self.comm, self.dks, self.dvs = comm, [None] * comm.p, [None] * comm.p
        self.t = 0

    def push(self, dk: Tensor, dv: Tensor) -> None:
        src = (self.comm.rank - self.t) % self.comm.p
        self.dks[src], self.dvs[src] = dk, dv
        self.t += 1

    def result(self) -> tuple[Tensor, Tensor]:
        if self.dks[0].shape == self.dvs[0].shape:
            dkv = self.comm._reduce_scatter(torch.stack([torch.stack(self.dks), torch.stack(self.dvs)], dim=1))
            return dkv[0], dkv[1]
        return self.comm._reduce_scatter(torch.stack(self.dks)), self.comm._reduce_scatter(torch.stack(self.dvs))


COMMS: dict[str, type[RingComm]] = {"p2p": P2PComm, "allgather": AllGatherComm}
