"""Zero host synchronizations per attention layer in steady state (issue 14).

A host sync (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``nonzero``, ``torch.equal``...)
stalls a GPU's queue: the ring loop's overlap is gone the moment one runs. Every tensor-to-Python
conversion is counted while a model of L attention layers runs forward + backward on a batch from
:func:`seqpar.shard_batch` (padded and packed rows, permuted layouts), for every strategy; one and
three layers must cost the same number (what the first layer of a batch may pay once -- the
per-batch plans, the loss's check of the batch's failures -- is paid once, not per layer). The
counts run on the CPU, where these calls are cheap, so that a GPU run is free of them. Ring block
plans are counted the same way: built once per batch, whatever the number of layers.

The per-batch failure check is covered too: a kernel failing in layer 2 of 3, forward or backward,
still raises on every rank, with the original message, at the loss or at the end of the backward.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor, nn

from seqpar.testing.attention_layer import AttentionLayer

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes

# tensor -> Python (a device-to-host copy that waits for the GPU queue), and torch.tensor: Python
# data -> a device tensor (a blocking host-to-device copy on a GPU)
_PATCHED = [(Tensor, n) for n in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
                                  "nonzero")] + [(torch, "equal"), (torch, "nonzero"), (torch, "tensor")]


@contextmanager
def count_host_syncs(where: Counter):
    """Count every tensor-to-Python conversion (by call site: seqpar file:line) inside the block."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in _PATCHED]

    def wrap(name, fn):
        def counted(*args, **kwargs):
            frame = sys._getframe(1)  # the innermost seqpar frame names the site
            while frame is not None and ("seqpar" not in frame.f_code.co_filename
                                         or "/tests/" in frame.f_code.co_filename):
                frame = frame.f_back
            site = "outside seqpar" if frame is None else \
                f"{frame.f_code.co_filename.split('src/')[-1]}:{frame.f_lineno}"
            where[f"{name} at {site}"] += 1
            return fn(*args, **kwargs)
        return counted

    for owner, name, fn in saved:
        setattr(owner, name, wrap(name, fn))
    try:
        yield where
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


class _Model(nn.Module):
    """Embedding, ``layers`` attention layers, a head: enough to run seqpar's loss and a backward."""

    def __init__(self, layers: int, vocab: int = 32, hidden: int = 24, heads: int = 6, kv_heads: int = 3,
                 dim: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, hidden, dtype=torch.float64)
        self.layers = nn.ModuleList(AttentionLayer(hidden, heads, kv_heads, dim) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, dtype=torch.float64)

    def loss(self, local: dict, mesh, strategy: str, kernel=None, fail_at: int | None = None) -> Tensor:
        from seqpar.batch.loss import sp_token_mean, token_losses
        from seqpar.comm.mesh import Axis, axis_group

        batch = local["seqpar_batch"]
        x = self.emb(local["input_ids"])  # [B, S/P, E]
        for i, layer in enumerate(self.layers):
            x = layer(x, mesh, strategy, batch.shard, kernel if i == fail_at else None)
        logits = self.head(x)
        return sp_token_mean(token_losses(logits, local["labels"]).sum(), batch, axis_group(mesh, Axis.SP.value))


def _batch(kind: str) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (2, 24), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padded":
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[0, 17:] = 0
        mask[1, :3] = 0
        batch["attention_mask"] = mask
    elif kind == "packed":
        batch["position_ids"] = torch.cat([torch.arange(9), torch.arange(11), torch.arange(4)])[None].expand(2, 24)
    return batch


# every strategy with padded and packed rows and a permuted layout (the default run) ...
CASES = [("ulysses", "padded", "zigzag"), ("ulysses", "packed", "doc-zigzag"), ("ring", "padded", "zigzag"),
         ("ring", "packed", "doc-zigzag"), ("hybrid", "padded", "zigzag"), ("hybrid", "packed", "doc-zigzag")]
# ... and the whole grid (make verify)
GRID = [(s, k, lay) for s in ("ulysses", "ring", "hybrid") for k in ("plain", "padded", "packed")
        for lay in ("contiguous", "zigzag", "doc-zigzag")]
FAILURES = [(s, w) for s in ("ulysses", "ulysses-local", "ring", "hybrid") for w in ("forward", "backward")] + [
    ("ring", "unchecked")]
FAILURES_GRID = [(s, w) for s in ("ulysses", "ulysses-local", "ring", "hybrid") for w in ("forward", "backward",
                                                                                       "unchecked")]


_MESHES: dict = {}  # per worker process: one mesh (its process groups) per kind


def _mesh(strategy: str):
    from seqpar.comm.mesh import init_mesh

    kind = "hybrid" if strategy == "hybrid" else "sp"
    if kind not in _MESHES:
        _MESHES[kind] = init_mesh(sp=4, ulysses=2, ring=2) if kind == "hybrid" else init_mesh(sp=4)
    return _MESHES[kind]


def _run_counts(rank: int, world: int, cases: list, deep: int) -> dict:
    """Host syncs and ring plans of one forward + backward per case: one layer, then ``deep``
    layers twice (the second batch: nothing left over from the first)."""
    import seqpar.attention.ring_loop as ring_module
    from seqpar.batch.sharding import shard_batch

    plans = Counter()
    plan_block = ring_module.plan_block

    def counted_plan(*args, **kwargs):
        plans["plans"] += 1
        return plan_block(*args, **kwargs)

    ring_module.plan_block = counted_plan
    out = {}
    for strategy, kind, layout in cases:
        mesh = _mesh(strategy)
        for layers, step in ((1, 0), (deep, 0), (deep, 1)):
            model = _Model(layers)
            local = shard_batch(_batch(kind), mesh, layout=layout)
            plans.clear()
            with count_host_syncs(Counter()) as syncs:
                model.loss(local, mesh, strategy).backward()
            out[(strategy, kind, layout, layers, step)] = (dict(syncs), plans["plans"])
    return out


def _run(rank: int, world: int, cases: list, deep: int, failure_cases: list) -> dict:
    torch.set_num_threads(1)
    return {"counts": _run_counts(rank, world, cases, deep), "failures": _run_failures(rank, world, failure_cases)}


def _spawn(cases: list, deep: int, failure_cases: list) -> dict:
    from seqpar.comm.launch import run_distributed

    runs = run_distributed(_run, 4, cases, deep, failure_cases, timeout=600, pg_timeout=30)
    return {"counts": [r["counts"] for r in runs], "failures": [r["failures"] for r in runs], "deep": deep}


@pytest.fixture(scope="module")
def runs():
    return _spawn(CASES, 2, FAILURES)


@pytest.fixture(scope="module")
def grid_runs():
    return _spawn(GRID, 3, FAILURES_GRID)


def _check_counts(runs: dict, case: tuple) -> None:
    deep = runs["deep"]
    for rank, per_rank in enumerate(runs["counts"]):
        one, plans_one = per_rank[(*case, 1, 0)]
        for step in range(2):
            many, plans_many = per_rank[(*case, deep, step)]
            # more syncs with more layers: some layer pays per call (fewer: a cache of the process)
            extra = {k: many.get(k, 0) - one.get(k, 0) for k in set(one) | set(many)}
            extra = {k: n for k, n in extra.items() if n > 0}
            assert not extra, f"rank {rank} batch {step}: host syncs added by layers 2..{deep}: {extra}"
            assert plans_one == plans_many, f"ring block plans built per layer: {plans_one} vs {plans_many}"
            if case[0] != "ulysses":
                assert plans_one > 0  # the counter sees the ring's plans


def _check_failure(runs: dict, strategy: str, when: str) -> None:
    """Every rank raises, with the failing rank's message, before the result is used: the loss (a
    forward failure), the end of backward() (a backward failure), the next batch's first layer (a
    forward whose output nothing checked)."""
    from seqpar.testing.attention_faults import Crash, crash_problems

    per_rank = [r[(strategy, when)] for r in runs["failures"]]
    crash = Crash(strategy, "backward" if when == "backward" else "forward")
    assert crash_problems(crash, per_rank) == []
    want_at = {"forward": "forward", "backward": "backward", "unchecked": "next batch"}[when]
    assert [seen["at"] for seen in per_rank] == [want_at] * len(per_rank)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_no_host_sync_per_layer(runs, case):
    _check_counts(runs, case)


@pytest.mark.heavy
@pytest.mark.parametrize("case", GRID, ids=lambda c: "-".join(c))
def test_no_host_sync_per_layer_grid(grid_runs, case):
    _check_counts(grid_runs, case)


def _run_failures(rank: int, world: int, cases: list) -> dict:
    """A kernel failing on the last rank in layer 2 of 3 of a training step, forward or backward;
    or a forward nothing checks (no loss, no backward), found by the next batch's first layer."""
    from seqpar.batch.sharding import shard_batch
    from seqpar.testing.attention_faults import FailingLocalKernel, FailingLseKernel

    out = {}
    for strategy, when in cases:
        name = strategy.split("-")[0]
        mesh, model = _mesh(name), _Model(3)
        kernel = (FailingLocalKernel if strategy == "ulysses-local" else FailingLseKernel)(
            world - 1, "backward" if when == "backward" else "forward")
        seen: dict = {"raised": None, "message": "", "cause": None, "at": None}
        at = "forward"
        try:
            local = shard_batch(_batch("packed"), mesh, layout="doc-zigzag")
            if when == "unchecked":
                batch = local["seqpar_batch"]
                x = model.emb(local["input_ids"])
                for i, layer in enumerate(model.layers):  # no loss, no backward: nothing checks
                    x = layer(x, mesh, name, batch.shard, kernel if i == 1 else None)
                at = "next batch"
                local = shard_batch(_batch("padded"), mesh)
                loss = model.loss(local, mesh, name)
            else:
                loss = model.loss(local, mesh, name, kernel, fail_at=1)
            at = "backward"
            loss.backward()
            at = None
        except Exception as e:
            seen.update(raised=type(e).__name__, message=str(e), at=at,
                        cause=type(e.__cause__).__name__ if e.__cause__ is not None else None)
        model.zero_grad()
        model.loss(shard_batch(_batch("padded"), mesh), mesh, name).backward()  # groups and record still work
        seen["after"] = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        out[(strategy, when)] = seen
    return out


@pytest.mark.parametrize("case", FAILURES, ids=lambda c: "-".join(c))
def test_failure_checked_once_per_batch_raises_on_every_rank(runs, case):
    _check_failure(runs, *case)


@pytest.mark.heavy
@pytest.mark.parametrize("case", FAILURES_GRID, ids=lambda c: "-".join(c))
def test_failure_checked_once_per_batch_grid(grid_runs, case):
    _check_failure(grid_runs, *case)
