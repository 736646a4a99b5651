"""A dynamic SP step is the unsharded model's step: one float64 step at 4 gloo ranks whose bins run at
degrees 1, 2 and 4 (padded, packed and plain rows of odd lengths; 4 query heads over 2 KV heads, so
fewer KV heads than the degree-4 block) gives the unsharded model's loss (1e-9) and every
parameter's gradient (1e-8), with packed rows' documents binned apart too, under
``sync_gradients``, under a plain world average (what stock DDP / FSDP2 compute) and under stock
``DistributedDataParallel``. Ranks that plan different rows, or rows that fit no degree, raise the
same ValueError on every rank before any other collective."""

from __future__ import annotations

import copy

import pytest
import torch

from seqpar.comm.launch import run_distributed
from seqpar.testing.model_parity import ModelCase, make_model, reference_token_loss

pytestmark = pytest.mark.distributed

WORLD = 4
BUDGET = 8  # tokens per rank per bin: <= 8 tokens -> degree 1, <= 16 -> 2, <= 32 -> 4
LOSS_TOL, GRAD_TOL = 1e-9, 1e-8


def _rows(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    rows = []
    for n, kind in [(5, "plain"), (7, "padded"), (3, "plain"), (13, "packed"), (15, "padded"), (11, "plain"),
                    (29, "packed"), (9, "plain"), (6, "packed")]:
        ids = torch.randint(0, vocab, (n,), generator=g)
        row = {"input_ids": ids, "labels": ids.clone()}
        if kind == "padded":  # right padding: the last quarter of the row
            mask = torch.ones(n, dtype=torch.long)
            mask[n - max(1, n // 4):] = 0
            row["attention_mask"] = mask
            row["labels"][mask == 0] = -100
        if kind == "packed":
            cut = n // 3
            row["position_ids"] = torch.cat([torch.arange(cut), torch.arange(n - cut)])
            row["labels"][cut] = -100  # a document's first token is not predicted from the previous one
        rows.append(row)
    return rows


def _cost(docs, k):  # a sub-group only for rows that do not fit one rank: degrees 1, 2 and 4 all occur
    # (a degree above 1 triples a rank's work, as on a CPU whose ranks share cores, so the mixed
    # schedule is predicted faster than static and plan_step keeps it, packed documents apart too)
    return sum(docs) / k * (3.0 if k > 1 else 1.0) + (5.0 if k > 1 else 0.0)


def _reference(base, rows):
    model = copy.deepcopy(base)
    parts = [reference_token_loss(model, {k: v[None] for k, v in r.items()}) for r in rows]
    n = sum(m for _, m in parts)
    loss = sum(t for t, _ in parts) / n
    loss.backward()
    return float(loss), {name: p.grad.clone() for name, p in model.named_parameters()}


def _step(base, mesh, rows, mode):
    import torch.distributed as dist

    import seqpar
    from seqpar.planner.bins import DynamicSP

    model = seqpar.parallelize(copy.deepcopy(base), mesh)
    runner = torch.nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
    dyn = DynamicSP(mesh, token_budget=BUDGET, cost=_cost, documents=mode == "documents")
    step = dyn.plan(rows)
    mine = step.schedule.bins_for(dist.get_rank())
    for i, local in enumerate(step):
        last = i == len(mine) - 1
        if mode == "ddp" and not last:
            with runner.no_sync():
                loss = runner(**local).loss
                loss.backward()
        else:
            loss = runner(**local).loss
            loss.backward()
        step.record(loss)
    if mode in ("sync", "documents"):
        seqpar.sync_gradients(model, mesh)
    elif mode == "average":  # the arithmetic of stock DDP / FSDP2: a plain mean over every rank
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return float(step.loss()), grads, dict(step.schedule.rows_at_degree), len(mine)


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    import seqpar
    from seqpar.planner.bins import DynamicSP

    base = make_model(ModelCase(model="tiny-llama", heads=4, kv_heads=2))
    rows = _rows(base.config.vocab_size)
    ref_loss, ref_grads = _reference(base, rows)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    out: dict = {}
    for mode in ("sync", "average", "ddp", "documents"):
        loss, grads, hist, n_bins = _step(base, mesh, rows, mode)
        out[mode] = (abs(loss - ref_loss), max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()),
                     hist, n_bins)
    dyn = DynamicSP(mesh, token_budget=BUDGET, cost=_cost)
    errors = {}
    for name, bad in [("rows differ", rows[:-1] if rank == 2 else rows), ("row too long", rows if rank else
                      [*rows, {"input_ids": torch.zeros(40, dtype=torch.long)}])]:
        try:
            dyn.plan(bad)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, timeout=600)


@pytest.mark.parametrize("mode", ["sync", "average", "ddp", "documents"])
def test_dynamic_step_equals_the_unsharded_model(results, mode):
    for rank, res in enumerate(results):
        loss_err, grad_err, hist, n_bins = res[mode]
        assert set(hist) == {1, 2, 4}, f"rank {rank}: bins ran at degrees {hist}, not 1, 2 and 4"
        # documents: the three packed rows' six documents binned apart
        assert sum(hist.values()) == (12 if mode == "documents" else 9), hist
        assert loss_err <= LOSS_TOL, f"rank {rank} {mode}: loss off by {loss_err:.3g}"
        assert grad_err <= GRAD_TOL, f"rank {rank} {mode}: a gradient off by {grad_err:.3g}"


def test_ranks_that_disagree_raise_the_same_value_error(results):
    for name, needle in [("rows differ", "differs across ranks"), ("row too long", "--token-budget")]:
        messages = [res["errors"][name] for res in results]
        assert all(m is not None for m in messages), f"{name}: a rank did not raise: {messages}"
        assert len(set(messages)) == 1, f"{name}: ranks raised different errors: {messages}"
        assert needle in messages[0], messages[0]
