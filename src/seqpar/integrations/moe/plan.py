"""Who owns which experts, and in which order a batch's rows travel to them: pure functions.

Experts are split over the ep ranks by the ``torch.tensor_split`` convention (the first ``E % ep``
ranks own one more), each rank a contiguous range::

    E = 5, ep = 2     rank 0: experts 0 1 2      rank 1: experts 3 4

A token routed to k experts is k rows, one per (token, slot). Sorting the rows by expert (stably)
groups them by owner, each owner's rows by expert::

    top_k_index [T, k] -> expert of each row [T*k] -> order [T*k] (sorted by expert)
    send buffer row i = hidden_states[order[i] // k]       counts [E]: rows per expert
    owner d receives recv[s][j] rows from source s for its j-th expert, source-major:
    local ids [R] = j of each received row     (R = sum of recv)

The results come back in the same order; :func:`unsort` puts them back at ``[T, k, H]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...comm.collectives import split_offsets, split_sizes


def owned_experts(num_experts: int, ep: int) -> list[int]:
    """How many experts each of ``ep`` ranks owns (rank order). Raises ValueError when some rank
    would own none (``ep > num_experts``)."""
    if ep > num_experts:
        raise ValueError(f"ep={ep} exceeds the {num_experts} experts of the layer: some ranks would own no expert; "
                         f"choose ep <= {num_experts}")
    return split_sizes(num_experts, ep)


def expert_range(num_experts: int, ep: int, rank: int) -> tuple[int, int]:
    """``(first expert, count)`` that ep rank ``rank`` owns."""
    sizes = owned_experts(num_experts, ep)
    return split_offsets(sizes)[rank], sizes[rank]


@dataclass(frozen=True)
class Routing:
    """One call's rows, in send order: ``order [T*k]`` the (token, slot) rows sorted by expert;
    ``tokens [T*k]`` the token of each sent row; ``counts [E]`` rows per expert."""

    order: Tensor
    tokens: Tensor
    counts: Tensor


def route(top_k_index: Tensor, num_experts: int) -> Routing:
    """The send order of ``top_k_index [T, k]`` (global expert ids, each in ``[0, E)``)."""
    k = top_k_index.shape[-1]
    experts = top_k_index.reshape(-1).long()  # [T*k]
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=num_experts)  # [E]
    return Routing(order, order // k, counts)


def per_rank(counts: list[int], owned: list[int]) -> list[int]:
    """Rows per rank from rows per expert (``owned``: experts per rank, contiguous, rank order)."""
    starts = split_offsets(owned)
    return [sum(counts[a:a + n]) for a, n in zip(starts, owned, strict=True)]


def local_ids(recv: list[list[int]], device: torch.device) -> Tensor:
    """``[R]`` the local expert of each received row (``recv[s][j]``: rows from source s for local
    expert j; rows arrive source-major, then by expert)."""
    n_local = len(recv[0]) if recv else 0
    ids = torch.arange(n_local, device=device).repeat(len(recv))  # [P * n_local]
    return ids.repeat_interleave(torch.tensor([c for row in recv for c in row], dtype=torch.long, device=device))


def unsort(rows: Tensor, order: Tensor, k: int) -> Tensor:
    """``rows [T*k, H]`` in send order -> ``[T, k, H]`` in (token, slot) order (differentiable: a gather)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return rows.index_select(0, inverse).view(-1, k, rows.shape[-1])
