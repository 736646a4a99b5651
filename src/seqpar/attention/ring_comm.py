"""How K/V blocks travel around the ring: small swappable objects behind one interface.

``comm.blocks(k, v)`` yields ``(owner, k_block, v_block)`` for ring steps ``t = 0..P-1`` (at step t
the block of rank ``(rank - t) % P``); compute placed between two yields overlaps the transfer.
``comm.grad_sink(k, v, dtype)`` takes the dK/dV of each yielded block in the same order (``push``:
the block's columns that got a gradient, added in place into an accumulator) and returns this
rank's own dK/dV summed over all ranks (``result``). Blocks have the same shape on every rank
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

Grads = tuple[tuple[int, int], Tensor, Tensor] | None
"""One block's dK/dV: ``((start, length), dk, dv)`` of the block's columns ``start .. start + length``
(the rest of the block got no gradient here); None: no gradient at all (a skipped block)."""


class GradSink(ABC):
    """Takes each yielded block's dK/dV in ring order; returns this rank's own, summed over ranks."""

    @abstractmethod
    def push(self, grads: Grads) -> None: ...

    @abstractmethod
    def result(self) -> tuple[Tensor, Tensor]: ...


def _add_into(acc_k: Tensor, acc_v: Tensor, grads: Grads) -> None:
    """Add one block's dK/dV into the ``[B, H_kv, L, D]`` accumulators, in place."""
    if grads is not None:
        (c0, nc), dk, dv = grads
        acc_k[:, :, c0:c0 + nc] += dk
        acc_v[:, :, c0:c0 + nc] += dv


class RingComm(ABC):
    """How K/V blocks travel (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup, grad_group: dist.ProcessGroup | None = None) -> None:
        self.group, self.p, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.grad_group = grad_group if grad_group is not None else group  # the same ranks, in the same order

    @abstractmethod
    def blocks(self, k: Tensor, v: Tensor) -> Iterator[tuple[int, Tensor, Tensor]]: ...

    @abstractmethod
    def grad_sink(self, k: Tensor, v: Tensor, dtype: torch.dtype) -> GradSink:
        """A sink for blocks shaped like ``k``, ``v``; dK/dV accumulate in ``dtype``."""


class P2PComm(RingComm):
    """K/V move one hop per step (batch_isend_irecv); dK/dV accumulators follow one step behind.
    Blocks land in two buffers used in turn (the one arriving and the one being computed on), so a
    call allocates them once, whatever P."""

    def blocks(self, k: Tensor, v: Tensor) -> Iterator[tuple[int, Tensor, Tensor]]:
        """Yield ``(owner, k, v)`` for t = 0..P-1; the caller's compute between yields overlaps the
        transfer of the next block. ``k``, ``v`` themselves are only read."""
        shift, cur, spare = RingShift(self.group), (k, v), None  # [B, H_kv, L, D] each, L the longest shard
        for t in range(self.p):
            if t < self.p - 1:
                shift.start(cur, into=spare or (torch.empty_like(k), torch.empty_like(v)))
            yield (self.rank - t) % self.p, cur[0], cur[1]
            if t < self.p - 1:
                # the block just sent is free again (never the caller's own k, v)
                sent, cur = cur, tuple(shift.wait())
                spare = sent if t > 0 else None

    def grad_sink(self, k: Tensor, v: Tensor, dtype: torch.dtype) -> _P2PGrads:
        return _P2PGrads(self.grad_group, k, v, dtype)


class _P2PGrads(GradSink):
    """Step t: add this rank's dK/dV of the block it holds into the accumulator that arrived with
    it and pass it on; after P steps each accumulator has visited every rank and is back home.
    Two accumulator pairs are used in turn (one travelling, one being added to). They travel on
    the ring's grad group (a second group over the same ranks, from :func:`seqpar.init_mesh`:
    under NCCL its own stream), so the next K/V block never queues behind them -- they move twice
    its bytes in float32. Without one, the ring's backward still pushes block t's dK/dV after
    posting the K/V hop of step t + 1, which keeps that hop ahead of them on the one stream."""

    def __init__(self, group: dist.ProcessGroup, k: Tensor, v: Tensor, dtype: torch.dtype) -> None:
        self.shift, self.t = RingShift(group), 0
        self.acc = (torch.zeros(k.shape, dtype=dtype, device=k.device),  # [B, H_kv, L, D]
                    torch.zeros(v.shape, dtype=dtype, device=v.device))  # [B, H_kv, L, Dv]
        self.spare: tuple[Tensor, Tensor] | None = None

    def push(self, grads: Grads) -> None:
        if self.t > 0:
            sent, self.acc = self.acc, tuple(self.shift.wait())
            self.spare = sent  # sent and received: free again
        _add_into(*self.acc, grads)
        spare = self.spare or tuple(torch.empty_like(a) for a in self.acc)
        self.shift.start(self.acc, into=spare)
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

    def grad_sink(self, k: Tensor, v: Tensor, dtype: torch.dtype) -> _AllGatherGrads:
        return _AllGatherGrads(self, k, v, dtype)


class _AllGatherGrads(GradSink):
    """Add every block's dK/dV into slot ``owner`` of one ``[P, ...]`` buffer, then reduce-scatter
    once: block r's sum over ranks lands on rank r."""

    def __init__(self, comm: AllGatherComm, k: Tensor, v: Tensor, dtype: torch.dtype) -> None:
        self.comm, self.t = comm, 0
        self.fused = k.shape == v.shape  # one buffer, one reduce-scatter for both
        if self.fused:
            self.full = torch.zeros((comm.p, 2, *k.shape), dtype=dtype, device=k.device)  # [P, 2, B, H_kv, L, D]
            self.dks, self.dvs = self.full[:, 0], self.full[:, 1]
        else:
            self.dks = torch.zeros((comm.p, *k.shape), dtype=dtype, device=k.device)  # [P, B, H_kv, L, D]
            self.dvs = torch.zeros((comm.p, *v.shape), dtype=dtype, device=v.device)  # [P, B, H_kv, L, Dv]

    def push(self, grads: Grads) -> None:
        src = (self.comm.rank - self.t) % self.comm.p
        _add_into(self.dks[src], self.dvs[src], grads)
        self.t += 1

    def result(self) -> tuple[Tensor, Tensor]:
        if self.fused:
            dkv = self.comm._reduce_scatter(self.full)
            return dkv[0], dkv[1]
        return self.comm._reduce_scatter(self.dks), self.comm._reduce_scatter(self.dvs)


COMMS: dict[str, type[RingComm]] = {"p2p": P2PComm, "allgather": AllGatherComm}
