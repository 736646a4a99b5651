"""A dynamic SP step beyond the plain exact step (tests/planner/test_dynamic_sp.py), at 4 gloo ranks
in one spawn:

- FSDP2 (``fully_shard`` over the flattened dp x sp mesh, its own reduce-scatter averaging) gives the
  unsharded model's loss (1e-9) and every gradient (1e-8), float64, bins at degrees 1, 2 and 4;
- a step cut into two micro-steps sharing the step's ``num_items`` (how ``seqpar train`` forms
  grad-accum micro-steps) gives them too;
- a bin below the job's sp degree refuses (``seqpar.Refused``, on every rank, no hang) a hybrid
  token mixer (LFM2's short convolution) and ``reduce_memory``'s tiled loss;
- a rank failing inside a bin of degree 2 (forward or backward) stops every rank with the real
  error within the fault bound;
- ranks that plan with different cost models or token budgets raise the same ValueError.

A fault (or a refusal) ends its process group, so each runs as a job of its own (forked from
zygotes started once: seqpar.testing.zygote)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_dynamic_sp import _reference, _rows  # the exact step's rows (padded, packed, odd) and its oracle

from seqpar.testing.fault_inject import Case, outcome_problems, run_case
from seqpar.testing.model_parity import ModelCase, make_model
from seqpar.testing.zygote import Zygotes

pytestmark = pytest.mark.distributed

WORLD = 4
BUDGET = 8
LOSS_TOL, GRAD_TOL = 1e-9, 1e-8
TWO_BINS_OF_2 = [13, 11]  # each needs 2 ranks (> 8 tokens, <= 16); together > 16: one bin per block of 2
PRELOAD = ("seqpar", "transformers", "seqpar.integrations.models", "transformers.models.llama.modeling_llama")
FAULTS = [Case("forward", rank=1, step=0), Case("backward", rank=2, step=0)]


def _cost(docs, k):  # as test_dynamic_sp: a sub-group only for rows that do not fit one rank, and the
    # mixed schedule predicted faster than static (a degree above 1 doubles a rank's work; a fixed cost grows with
    # the degree), so plan_step keeps it
    return sum(docs) / k * (2.0 if k > 1 else 1.0) + (5.0 * k if k > 1 else 0.0)


def _plain_rows(lengths, vocab, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(0, vocab, (n,), generator=g)), "labels": ids.clone()}
            for n in lengths]


def _grad_err(model, ref_grads):
    def full(g):
        return g.full_tensor() if hasattr(g, "full_tensor") else g
    return max(float((full(p.grad) - ref_grads[n]).abs().max()) for n, p in model.named_parameters())


def _fsdp_step(base, mesh, rows):
    import seqpar
    from seqpar.planner.bins import DynamicSP

    model = seqpar.parallelize(copy.deepcopy(base), mesh)
    seqpar.apply_fsdp(model, mesh, reshard_after_forward=False)
    step = DynamicSP(mesh, token_budget=BUDGET, cost=_cost).plan(rows)
    for local in step.fsdp(model):
        loss = model(**local).loss
        loss.backward()
        step.record(loss)
    return float(step.loss()), model, dict(step.schedule.rows_at_degree)


def _micro_step(base, mesh, rows):
    import seqpar
    from seqpar.planner.bins import DynamicSP, step_targets

    model = seqpar.parallelize(copy.deepcopy(base), mesh)
    dyn = DynamicSP(mesh, token_budget=BUDGET, cost=_cost)
    n = step_targets(rows)
    total = 0.0
    for part in (rows[::2], rows[1::2]):
        step = dyn.plan(part, num_items=n)
        for local in step:
            loss = model(**local).loss
            loss.backward()
            step.record(loss)
        total += float(step.loss())
    seqpar.sync_gradients(model, mesh)
    return total, model


def _refusal(rank: int, world: int, what: str) -> tuple[str | None, str]:
    """Job: a step of two degree-2 bins through a hybrid model or a tiled loss; what this rank raised."""
    torch.set_num_threads(1)
    import seqpar
    from seqpar.planner.bins import DynamicSP
    from seqpar.testing.zoo import VARIANTS, build_tiny

    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    if what == "mixer":
        model_type, overrides = VARIANTS["lfm2/conv-layers"]
        model = seqpar.parallelize(build_tiny(model_type, **overrides), mesh)
    else:
        model = seqpar.parallelize(make_model(ModelCase(model="tiny-llama", heads=4, kv_heads=2)), mesh)
        seqpar.reduce_memory(model, mesh, tiled_loss=True, tiled_mlp=False, checkpoint="none")
    rows = _plain_rows(TWO_BINS_OF_2, model.config.vocab_size)
    try:
        step = DynamicSP(mesh, token_budget=BUDGET, cost=_cost).plan(rows)
        for local in step:
            model(**local).loss.backward()
        seqpar.sync_gradients(model, mesh)
    except Exception as e:
        return type(e).__name__, str(e)
    return None, ""


def _fault(rank: int, world: int, case: Case):
    """Job: ``case`` fires inside one of two degree-2 bins; what this rank raised, and when."""
    torch.set_num_threads(1)
    import seqpar
    from seqpar.planner.bins import DynamicSP

    base = make_model(ModelCase(model="tiny-llama", heads=4, kv_heads=2))
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    model = seqpar.parallelize(base, mesh)

    def body(inj):
        inj.install(model)
        inj.step = 0
        step = DynamicSP(mesh, token_budget=BUDGET, cost=_cost).plan(_plain_rows(TWO_BINS_OF_2, base.config.vocab_size))
        assert [b.degree for b in step.schedule.bins] == [2, 2], step.schedule
        for local in step:
            model(**local).loss.backward()
        seqpar.sync_gradients(model, mesh)

    return run_case(case, body)


def _exact(rank: int, world: int) -> dict:
    """Job: FSDP2 and micro-steps against the oracle; ranks that disagree on the schedule."""
    torch.set_num_threads(1)
    import seqpar
    from seqpar.planner.bins import DynamicSP

    base = make_model(ModelCase(model="tiny-llama", heads=4, kv_heads=2))
    rows = _rows(base.config.vocab_size)
    ref_loss, ref_grads = _reference(base, rows)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    out: dict = {}
    loss, model, hist = _fsdp_step(base, mesh, rows)
    out["fsdp"] = (abs(loss - ref_loss), _grad_err(model, ref_grads), hist)
    loss, model = _micro_step(base, mesh, rows)
    out["micro"] = (abs(loss - ref_loss), _grad_err(model, ref_grads))
    disagree = {}
    for name, kw in [("cost", dict(cost=(lambda d, k: sum(d) / k) if rank == 3 else _cost)),
                     ("token budget", dict(cost=_cost, token_budget=BUDGET + (rank == 0)))]:
        dyn = DynamicSP(mesh, **{"token_budget": BUDGET, **kw})
        try:
            dyn.plan(rows)
            disagree[name] = None
        except ValueError as e:
            disagree[name] = str(e)
    out["disagree"] = disagree
    return out


@pytest.fixture(scope="module")
def results():
    with Zygotes(WORLD, preload=PRELOAD) as z:
        out = {"exact": z.run(_exact, timeout=300)}
        for what in ("mixer", "tiled loss"):
            out[f"refused: {what}"] = z.run(_refusal, what, timeout=120)
        out["faults"] = [z.run(_fault, case, timeout=120, pg_timeout=60, strict=False) for case in FAULTS]
    return out


@pytest.mark.parametrize("mode", ["fsdp", "micro"])
def test_fsdp2_and_micro_steps_equal_the_unsharded_model(results, mode):
    for rank, res in enumerate(results["exact"]):
        loss_err, grad_err = res[mode][:2]
        assert loss_err <= LOSS_TOL, f"rank {rank} {mode}: loss off by {loss_err:.3g}"
        assert grad_err <= GRAD_TOL, f"rank {rank} {mode}: a gradient off by {grad_err:.3g}"
    assert set(results["exact"][0]["fsdp"][2]) == {1, 2, 4}


@pytest.mark.parametrize("what, needle", [("mixer", "Lfm2ShortConv in a dynamic SP schedule's bin of degree 2"),
                                          ("tiled loss", "tiled loss in a dynamic SP schedule's bin of degree 2")])
def test_a_bin_below_sp_refuses_on_every_rank(results, what, needle):
    seen = results[f"refused: {what}"]
    assert all(raised == "Refused" for raised, _ in seen), seen
    assert all(needle in message for _, message in seen), seen


@pytest.mark.parametrize("i", range(len(FAULTS)), ids=[c.label() for c in FAULTS])
def test_a_fault_in_a_bin_of_degree_2_stops_every_rank(results, i):
    outcomes = results["faults"][i]
    assert outcome_problems(FAULTS[i], outcomes) == []


def test_ranks_that_disagree_on_the_schedule_raise_the_same_value_error(results):
    for name in ("cost", "token budget"):
        messages = [res["disagree"][name] for res in results["exact"]]
        assert all(m is not None for m in messages), f"{name}: a rank did not raise: {messages}"
        assert len(set(messages)) == 1, f"{name}: ranks raised different errors: {messages}"
        assert "differs across ranks" in messages[0], messages[0]
