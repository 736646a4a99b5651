"""Running a dynamic SP schedule: each bin of a step packed into one row and sharded over its block
of ranks, with the loss scaled so that the plain average of the gradients over every rank is exact.

    dyn = DynamicSP(mesh, token_budget=4096, cost=cost)   # block meshes built once (collective)
    step = dyn.plan(rows)                                 # the step's rows, the same on every rank
    for local in step:                                    # this rank's bins, largest degree first
        loss = model(**local).loss                        # the bin's share of the step's token mean
        loss.backward(); step.record(loss)
    seqpar.sync_gradients(model, mesh)                    # or stock DDP / FSDP2: the world average
    step.loss()                                           # the step's token mean (one all-reduce)

Under FSDP2 iterate ``step.fsdp(model)`` instead of ``step``: it holds FSDP's reduce-scatter back
until every bin of this rank has run (see :meth:`StepBins.fsdp`).

Exactness: every bin is sharded with ``num_items_in_batch = N`` (the targets of the whole step, all
ranks) and ``grad_ranks = W`` (the job's ranks): its loss is ``bin_sum / N`` on each of its ``k``
ranks, and each rank back-propagates its own tokens' share times ``W / N``; each token belongs to
one rank of one bin, so the average over the ``W`` ranks is ``d(sum of every target / N)``: the
unsharded model's gradient of the step's token mean. The step's loss counts each bin once:
``sum over ranks of loss_b / k_b``, all-reduced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..batch.sharding import count_target_tokens, shard_batch
from ..batch.targets import IGNORE_INDEX
from ..comm import collectives
from ..comm.agree import check, share
from ..comm.degrees import degree_meshes
from .schedule import Bin, Cost, Schedule, plan_step

ROW_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
SP_SCHEDULES = ("static", "dynamic")
"""The SP schedules of ``seqpar train --sp-schedule`` and ``parallelize_trainer(sp_schedule=)``."""


def row_tokens(row: Mapping[str, Any]) -> tuple[Tensor, Tensor | None, Tensor]:
    """``(input_ids [n], labels [n] or None, position_ids [n])`` of a row's real tokens: padding
    (``attention_mask == 0``) dropped, positions as given (packed documents restart) or ``0..n-1``.
    A row is ``[S]`` or ``[1, S]``. Raises ValueError for other keys or shapes."""
    extra = sorted(set(row) - set(ROW_KEYS))
    if extra:
        raise ValueError(f"a dynamic schedule's row takes {list(ROW_KEYS)}; got {extra} too")
    ids = row["input_ids"]
    if ids.dim() == 2 and ids.shape[0] == 1:
        row = {k: v[0] for k, v in row.items()}
        ids = row["input_ids"]
    if ids.dim() != 1:
        raise ValueError(f"a row's input_ids must be [S] or [1, S], got {list(ids.shape)}")
    mask = row.get("attention_mask")
    keep = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    pos = row.get("position_ids")
    if pos is None:
        pos = torch.arange(int(keep.sum()))
    else:
        pos = pos[keep]
        if pos.numel() and int(pos[0]) != 0:
            raise ValueError(f"a row's position_ids must start at 0 (got {int(pos[0])}): rows are packed together")
    labels = row.get("labels")
    return ids[keep], None if labels is None else labels[keep], pos


RowTokens = tuple[Tensor, Tensor | None, Tensor]
"""A row's real tokens: :func:`row_tokens`' ``(input_ids, labels, position_ids)``."""


def row_documents(row: Mapping[str, Any]) -> list[int]:
    """Token counts of a row's documents (split where the positions restart)."""
    return _documents(row_tokens(row), "position_ids" in row)


def _documents(tokens: RowTokens, positioned: bool) -> list[int]:
    pos = tokens[2]
    if not positioned:  # 0..n-1: one document (no diff to look for restarts in)
        return [pos.numel()] if pos.numel() else []
    starts = [0, *((torch.diff(pos) != 1).nonzero().flatten() + 1).tolist(), pos.numel()]
    return [b - a for a, b in zip(starts[:-1], starts[1:], strict=True) if b > a]


def _restarts(tokens: RowTokens) -> list[RowTokens]:
    """A packed row's tokens cut where its positions restart at 0: units that each start at 0, so
    packed together again they keep their boundaries (a document not starting at 0 stays with the
    one before it)."""
    ids, labels, pos = tokens
    cuts = [0, *(pos[1:] == 0).nonzero().flatten().add(1).tolist(), pos.numel()]
    return [(ids[a:b], None if labels is None else labels[a:b], pos[a:b])
            for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


def pack_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
    """The rows' real tokens as one packed row ``[1, T]`` (each row's documents stay documents)."""
    return _packed([row_tokens(r) for r in rows])


def _packed(parts: Sequence[RowTokens]) -> dict[str, Tensor]:
    out = {"input_ids": torch.cat([p[0] for p in parts])[None],
           "position_ids": torch.cat([p[2] for p in parts])[None]}
    if all(p[1] is not None for p in parts):
        out["labels"] = torch.cat([p[1] for p in parts])[None]
    elif any(p[1] is not None for p in parts):
        raise ValueError("either every row of a step has labels or none has")
    return out


class StepBins:
    """One step under a :class:`Schedule`: iterate it for this rank's bins (local batches)."""

    def __init__(self, dyn: DynamicSP, schedule: Schedule, rows: Sequence[RowTokens], num_items: float) -> None:
        self.schedule, self.num_items = schedule, num_items
        self._dyn, self._rows = dyn, rows  # each row's real tokens, read once by DynamicSP.plan
        self._rank = dist.get_rank(dyn.degrees.all_group)
        self._losses: list[tuple[Tensor, int]] = []

    @property
    def mine(self) -> list[Bin]:
        """This rank's bins, in the order iterating yields their local batches."""
        return self.schedule.bins_for(self._rank)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for b in self.mine:
            batch = _packed([self._rows[i] for i in b.rows])
            yield shard_batch(batch, self._dyn.degrees.mesh(b.degree), layout=self._dyn.layout,
                              num_items_in_batch=self.num_items, grad_ranks=self._dyn.degrees.world,
                              device=self._dyn.device)

    def fsdp(self, model: Any, loss_of: Callable[[dict[str, Any]], Tensor] | None = None
             ) -> Iterator[dict[str, Any]]:
        """This rank's bins for ``model`` under FSDP2 (``fully_shard`` with
        ``reshard_after_forward=False``, needed: by default each bin's forward reshards and its
        backward all-gathers again, over every rank, which ranks with fewer bins never join -- a
        hang): every bin runs with gradient sync off and the parameters kept gathered; when the
        loop asks past the last bin, one flush pass (a 4-token degree-1 row times zero)
        reduce-scatters the accumulated gradients. So every rank runs the same FSDP collectives
        whatever its number of bins (none too), and none inside a bin: a reduce-scatter in a bin's
        backward would wait on a peer still inside that bin's all-to-alls (a hang). Each call
        ends in step on every rank, so grad-accum micro-steps call it once each (one reduce-scatter
        per micro-step; FSDP2 adds them into the sharded gradients). ``loss_of``: the loss of a local
        batch (default ``model(**local).loss``; a preference objective's: the flush row holds two
        documents, one pair)."""
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        yield from self
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        ids = torch.zeros(1, 4, dtype=torch.long)
        local = shard_batch({"input_ids": ids, "labels": ids, "position_ids": torch.tensor([[0, 1, 0, 1]])},
                            self._dyn.degrees.mesh(1), num_items_in_batch=1.0, grad_ranks=self._dyn.degrees.world,
                            device=self._dyn.device)
        loss = model(**local).loss if loss_of is None else loss_of(local)
        (loss * 0.0).backward()  # adds exact zeros: the gradients are the bins' alone

    def record(self, loss: Tensor) -> None:
        """Note a bin's loss (in iteration order) for :meth:`loss`."""
        self._losses.append((loss.detach(), self.mine[len(self._losses)].degree))

    def loss(self) -> Tensor:
        """The step's token-weighted mean over every rank's bins (one all-reduce over the job)."""
        mine = sum((v.double() / k for v, k in self._losses), torch.zeros((), dtype=torch.float64))
        total = mine.reshape(1).to(collectives.comm_device(self._dyn.degrees.all_group))
        collectives.all_reduce(total, group=self._dyn.degrees.all_group)
        return total[0]


class DynamicSP:
    """Per-step dynamic SP schedules over ``mesh`` (a ``dp x sp`` mesh, :func:`seqpar.init_mesh`).

    ``token_budget``: tokens per rank per bin; ``cost``: predicted seconds of a bin
    (:func:`seqpar.planner.work.bin_seconds` bound to a model and machine); ``degrees``: the degrees
    allowed (default ``1, 2, 4, ..., sp``; ``(sp,)`` is the static schedule). ``documents``: bin
    a packed row's documents apart (each run of positions from 0 is a unit of its own): they attend
    only within themselves and their targets are the same, so the step's loss and gradients are those
    of the rows as given, while a row packed to ``--seq-len`` of short documents no longer needs the
    degree of its length. Building it is collective the first time over a mesh: every rank creates
    the block groups, once per mesh (:func:`~seqpar.comm.degrees.degree_meshes`).
    """

    def __init__(self, mesh: DeviceMesh, *, token_budget: int, cost: Cost, degrees: Sequence[int] | None = None,
                 layout: str = "contiguous", device: torch.device | str | None = None, documents: bool = False) -> None:
        self.degrees = degree_meshes(mesh)
        self.token_budget, self.cost, self.layout, self.device = token_budget, cost, layout, device
        self.allowed = tuple(degrees) if degrees is not None else self.degrees.degrees
        self.documents = documents

    def targets(self, rows: Sequence[Mapping[str, Any]], *, ignore_index: int = IGNORE_INDEX) -> float:
        """The targets of ``rows`` (:func:`step_targets`): the ``num_items`` of a step of them."""
        return step_targets(rows, ignore_index=ignore_index)

    def plan(self, rows: Sequence[Mapping[str, Any]], *, ignore_index: int = IGNORE_INDEX,
             num_items: float | None = None) -> StepBins:
        """The schedule of a step of ``rows`` (the same rows on every rank of the job). ``num_items``:
        the loss denominator when these rows are one micro-step of several (the targets of the whole
        step, e.g. :func:`step_targets` of all its rows; default: these rows' targets). Raises the
        same ValueError on every rank, before any other collective, for a bad row or budget, or when
        the ranks' rows or schedules differ (one small all-gather)."""
        problem, docs, schedule, n, tokens = None, [], None, 0.0, []
        try:  # each row's tokens read once: its documents, the step's targets and its bin's packed row
            units = [(row_tokens(r), "position_ids" in r) for r in rows]
            if self.documents:  # a packed row's documents, each a unit of its own
                units = [(piece, True) for t, positioned in units for piece in (_restarts(t) if positioned else [t])]
            tokens = [t for t, _ in units]
            docs = [_documents(t, positioned) for t, positioned in units]
            schedule = plan_step(docs, world=self.degrees.world, sp=self.degrees.sp, token_budget=self.token_budget,
                                 cost=self.cost, degrees=self.allowed)
            n = _targets(tokens, ignore_index)
        except ValueError as e:
            problem = str(e)
        facts = {"rows": float(len(docs)), "tokens": float(sum(map(sum, docs))),
                 "lengths": float(sum((i + 1) * sum(d) * len(d) for i, d in enumerate(docs)) % 2**50),
                 "targets": n, "num_items": float(n if num_items is None else num_items),
                 "token_budget": float(self.token_budget),
                 "bins": float(len(schedule.bins)) if schedule else -1.0,
                 "placement": float(_fingerprint(schedule)) if schedule else -1.0}
        table = share(facts, self.degrees.all_group, problem=problem)
        # a rank's own problem says it all (its facts differ as a consequence): the same choice on every rank
        check(table, what="dynamic SP step", same=[] if any(table.problems) else list(facts),
              describe=lambda f: f"the step's {f}",
              hint="every rank must plan the same rows with the same token budget and cost model")
        assert schedule is not None
        return StepBins(self, schedule, tokens, n if num_items is None else num_items)


def step_targets(rows: Sequence[Mapping[str, Any]], *, ignore_index: int = IGNORE_INDEX) -> float:
    """The targets of ``rows`` (each row's own, packed documents' first tokens not predicted from
    the previous document): the token mean's denominator of a step of these rows."""
    return _targets([row_tokens(r) for r in rows], ignore_index)


def _targets(rows: Sequence[RowTokens], ignore_index: int) -> float:
    """The rows' targets counted over them packed into one row: each row's positions start at 0, so
    a row's last token never predicts the next row's first, as if counted row by row (one count of
    T tokens, not one per row). Rows with labels and rows without count apart."""
    labelled = [r for r in rows if r[1] is not None]
    return float(count_target_tokens(_packed(labelled), ignore_index=ignore_index)) if labelled else 0.0


def _fingerprint(schedule: Schedule) -> int:
    h = 0
    for i, b in enumerate(schedule.bins):
        h = (h * 1000003 + (i + 1) * (b.degree * 7919 + b.first_rank * 131 + sum(b.rows) + len(b.rows))) % 2**50
    return h
