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

import traceback
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor, nn

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes

_PATCHED = [(Tensor, n) for n in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
                                  "nonzero")] + [(torch, "equal"), (torch, "nonzero")]


@contextmanager
def count_host_syncs(where: Counter):
    """Count every tensor-to-Python conversion (by call site: seqpar file:line) inside the block."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in _PATCHED]

    def wrap(name, fn):
        def counted(*args, **kwargs):
            site = next((f"{f.filename.split('src/')[-1]}:{f.lineno}" for f in reversed(traceback.extract_stack()[:-1])
                         if "seqpar" in f.filename and "/tests/" not in f.filename), "outside seqpar")
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


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q = nn.Linear(hidden, heads * dim, dtype=torch.float64)
        self.kv = nn.Linear(hidden, 2 * kv_heads * dim, dtype=torch.float64)
        self.o = nn.Linear(heads * dim, hidden, dtype=torch.float64)

    def forward(self, x: Tensor, mesh, strategy: str, shard, kernel) -> Tensor:
        from seqpar.attention.dispatch import sp_attention

        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim)  # [B, S/P, H, D]
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.dim).unbind(2)  # [B, S/P, H_kv, D]
        out = sp_attention(q, k, v, mesh=mesh, strategy=strategy, causal=True, kernel=kernel, shard=shard,
                           validate=False)
        return x + self.o(out.reshape(b, s, -1))


class _Model(nn.Module):
    """Embedding, ``layers`` attention layers, a head: enough to run seqpar's loss and a backward."""

    def __init__(self, layers: int, vocab: int = 32, hidden: int = 24, heads: int = 6, kv_heads: int = 3,
                 dim: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, hidden, dtype=torch.float64)
        self.layers = nn.ModuleList(_Layer(hidden, heads, kv_heads, dim) for _ in range(layers))
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


CASES = [("ulysses", "packed", "contiguous"), ("ulysses", "padded", "zigzag"),
         ("ring", "packed", "doc-zigzag"), ("ring", "padded", "zigzag"), ("ring", "plain", "contiguous"),
         ("hybrid", "packed", "doc-zigzag"), ("hybrid", "padded", "contiguous")]


def _mesh(strategy: str):
    from seqpar.comm.mesh import init_mesh

    return init_mesh(sp=4, ulysses=2, ring=2) if strategy == "hybrid" else init_mesh(sp=4)


def _run_counts(rank: int, world: int) -> dict:
    import seqpar.attention.ring as ring_module
    from seqpar.batch.sharding import shard_batch

    torch.set_num_threads(1)
    plans = Counter()
    plan_block = ring_module.plan_block

    def counted_plan(*args, **kwargs):
        plans["plans"] += 1
        return plan_block(*args, **kwargs)

    ring_module.plan_block = counted_plan
    out = {}
    meshes = {}
    for strategy, kind, layout in CASES:
        mesh = meshes.setdefault(strategy, _mesh(strategy))
        for layers in (1, 3):
            model = _Model(layers)
            for step in range(2):  # the second batch: nothing left over from the first one
                local = shard_batch(_batch(kind), mesh, layout=layout)
                plans.clear()
                with count_host_syncs(Counter()) as syncs:
                    model.loss(local, mesh, strategy).backward()
                out[(strategy, kind, layout, layers, step)] = (dict(syncs), plans["plans"])
    return out


@pytest.fixture(scope="module")
def counts():
    from seqpar.comm.launch import run_distributed

    return run_distributed(_run_counts, 4, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_no_host_sync_per_layer(counts, case):
    for rank, per_rank in enumerate(counts):
        for step in range(2):
            one, plans_one = per_rank[(*case, 1, step)]
            three, plans_three = per_rank[(*case, 3, step)]
            extra = {k: three.get(k, 0) - one.get(k, 0) for k in set(one) | set(three)}
            extra = {k: n for k, n in extra.items() if n}
            assert not extra, f"rank {rank} batch {step}: host syncs added by layers 2..3: {extra}"
            assert plans_one == plans_three, f"ring block plans built per layer: {plans_one} vs {plans_three}"
            if case[0] != "ulysses":
                assert plans_one > 0  # the counter sees the ring's plans


def _run_failures(rank: int, world: int) -> dict:
    """A kernel failing on the last rank in layer 2 of 3 of a training step, forward or backward;
    and a forward nothing checks (no loss, no backward), found by the next batch's first layer."""
    from seqpar.batch.sharding import shard_batch
    from seqpar.testing.attention_faults import FailingLocalKernel, FailingLseKernel

    torch.set_num_threads(1)
    out = {}
    for strategy in ("ulysses", "ulysses-local", "ring", "hybrid"):
        mesh = _mesh(strategy.split("-")[0])
        name = strategy.split("-")[0]
        model = _Model(3)
        for when in ("forward", "backward", "unchecked"):
            kernel = (FailingLocalKernel if strategy == "ulysses-local" else FailingLseKernel)(
                world - 1, "backward" if when == "backward" else "forward")
            seen: dict = {"raised": None, "message": "", "cause": None, "at": None}
            at = "forward"
            try:
                local = shard_batch(_batch("packed"), mesh, layout="doc-zigzag" if name != "ulysses" else "contiguous")
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
            local = shard_batch(_batch("padded"), mesh)
            model.loss(local, mesh, name).backward()  # the groups and the record still work
            seen["after"] = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            out[(strategy, when)] = seen
    return out


@pytest.fixture(scope="module")
def failures():
    from seqpar.comm.launch import run_distributed

    return run_distributed(_run_failures, 4, timeout=240, pg_timeout=30)


@pytest.mark.parametrize("strategy", ["ulysses", "ulysses-local", "ring", "hybrid"])
@pytest.mark.parametrize("when", ["forward", "backward", "unchecked"])
def test_failure_checked_once_per_batch_raises_on_every_rank(failures, strategy, when):
    """Every rank raises, with the failing rank's message, before the result is used: the loss (a
    forward failure), the end of backward() (a backward failure), the next batch's first layer (a
    forward whose output nothing checked)."""
    from seqpar.testing.attention_faults import Crash, crash_problems

    per_rank = [r[(strategy, when)] for r in failures]
    crash = Crash(strategy, "backward" if when == "backward" else "forward")
    assert crash_problems(crash, per_rank) == []
    want_at = {"forward": "forward", "backward": "backward", "unchecked": "next batch"}[when]
    assert [seen["at"] for seen in per_rank] == [want_at] * len(per_rank)
