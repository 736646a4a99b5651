"""A dynamic SP step beyond the plain exact step (tests/planner/test_dynamic_sp.py), at 4 gloo ranks
in one spawn:

- FSDP2 (``fully_shard`` over the flattened dp x sp mesh, its own reduce-scatter averaging) gives the
  unsharded model's loss (1e-9) and every gradient (1e-8), float64, bins at degrees 1, 2 and 4;
- a step cut into two micro-steps sharing the step's ``num_items`` (how ``seqpar train`` forms
  grad-accum micro-steps) gives them too;
- bins at degrees 1, 2 and 4 give the unsharded model's loss and gradients (the same bounds) with
  ``reduce_memory``'s tiled loss, tiled MLP and layer checkpointing (each reduces or runs over the
  bin's block of ranks), and through a hybrid model's token mixer: LFM2's short convolution (halo)
  and Qwen3-Next's Gated DeltaNet in state passing (with seqpar's float64 scans; the parameters
  the model itself sums in float32 held to float32 precision);
- a bin (below sp, or at sp) refuses (``seqpar.Refused``, on every rank, no hang) an MoE router aux loss: a
  statistic of the whole step's rows, which a bin holds only part of;
- a rank failing inside a bin of degree 2 (forward or backward) stops every rank with the real
  error within the fault bound;
- ranks that plan with different cost models or token budgets raise the same ValueError.

A fault (or a refusal) ends its process group, so each runs as a job of its own (forked from
zygotes started once: seqpar.testing.zygote)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from test_dynamic_sp import _reference, _rows  # the exact step's rows (padded, packed, odd) and its oracle

from seqpar.testing.fault_inject import Case, outcome_problems, run_case
from seqpar.testing.model_parity import F32_RTOL, ModelCase, make_model
from seqpar.testing.zygote import Zygotes

pytestmark = pytest.mark.distributed

WORLD = 4
BUDGET = 8
LOSS_TOL, GRAD_TOL = 1e-9, 1e-8
TWO_BINS_OF_2 = [13, 11]  # each needs 2 ranks (> 8 tokens, <= 16); together > 16: one bin per block of 2
PRELOAD = ("seqpar", "transformers", "seqpar.integrations.models", "transformers.models.llama.modeling_llama")
FAULTS = [Case("forward", rank=1, step=0), Case("backward", rank=2, step=0)]
SWITCHED = {"memory": {}, "short conv": {"Lfm2ShortConv": "halo"},  # what runs in bins -> the modes it takes
            "state passing": {"Qwen3NextGatedDeltaNet": "state"}}
RECURRENT = ("state passing", "measured")  # Qwen3-Next's Gated DeltaNet: forced to state passing, or left to
# seqpar's measurement of state passing against heads (inside each bin, over its block; heavy: ~15 s)


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


def _switched_model(what: str):
    """``what``'s float64 model, unsharded: tiny Llama for the memory switches, a tiny hybrid for a
    token mixer (LFM2's short convolution: halo or gathered; Qwen3-Next's Gated DeltaNet: state passing)."""
    from seqpar.testing.zoo import VARIANTS, build_tiny

    if what == "memory":
        return make_model(ModelCase(model="tiny-llama", heads=4, kv_heads=2))
    if what == "short conv":
        model_type, overrides = VARIANTS["lfm2/conv-layers"]
        return build_tiny(model_type, **overrides)
    return build_tiny("qwen3_next", layer_types=["linear_attention", "full_attention"], num_hidden_layers=2,
                      mlp_only_layers=[0, 1], output_router_logits=False)  # dense MLPs: no router loss


def _switched(rank: int, world: int, what: str) -> tuple[float, float, float, dict, dict]:
    """Job: the exact step's rows (bins at degrees 1, 2 and 4) through ``what`` (reduce_memory's tiled
    loss and MLP, or a hybrid model's token mixer) against the unsharded model: ``(loss error, largest
    gradient error, largest relative error of a gradient the model sums in float32 itself, rows per
    degree, the mixers' modes)``."""
    torch.set_num_threads(1)
    import seqpar
    from seqpar.integrations.mixers import chosen_modes, set_mixer_mode
    from seqpar.planner.bins import DynamicSP
    from seqpar.testing.model_parity import case_batch, precision_floor
    from seqpar.testing.scans64 import float64_scans

    base = _switched_model(what)
    # the model's own scans compute in float32; seqpar's float64 ones (the same signatures) make the
    # comparison one of float64 rounding
    with float64_scans(base) if what in RECURRENT else contextlib.nullcontext():
        rows = _rows(base.config.vocab_size)
        ref_loss, ref_grads = _reference(base, rows)
        # parameters the model sums in float32 itself (Qwen3-Next's norms, its A_log.float()): their
        # gradients depend on how tokens are grouped, as across ranks -- held to float32 precision
        floor = (precision_floor(base, case_batch(ModelCase(batch="packed", seq=17), base.config.vocab_size)).params
                 if what in RECURRENT else frozenset())
        mesh = seqpar.init_mesh(sp=world, device_type="cpu")
        model = seqpar.parallelize(copy.deepcopy(base), mesh)
        if what == "memory":  # tiles far below the shards: several loss and MLP tiles per bin
            seqpar.reduce_memory(model, mesh, tiled_loss=True, tiled_mlp=True, checkpoint="layers", loss_tile=4,
                                 mlp_tile=3)
        elif what == "state passing":
            set_mixer_mode(model, "state")
        step = DynamicSP(mesh, token_budget=BUDGET, cost=_cost).plan(rows)
        for local in step:
            loss = model(**local).loss
            loss.backward()
            step.record(loss)
        seqpar.sync_gradients(model, mesh)
    errs = {n: float((p.grad - ref_grads[n]).abs().max()) for n, p in model.named_parameters()}
    strict = max(e for n, e in errs.items() if n not in floor)
    f32 = max((errs[n] / float(ref_grads[n].abs().max()) for n in floor), default=0.0)
    return (abs(float(step.loss()) - ref_loss), strict, f32, dict(step.schedule.rows_at_degree),
            chosen_modes(model) if what != "memory" else {})


def _router_refusal(rank: int, world: int) -> list[tuple[str | None, str]]:
    """Job: a step of two degree-2 bins, then the same rows with every bin at the job's sp, through an
    MoE model with its router aux loss on; what this rank raised each time."""
    torch.set_num_threads(1)
    import seqpar
    from seqpar.planner.bins import DynamicSP
    from seqpar.testing.zoo import build_tiny

    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    model = seqpar.parallelize(build_tiny("qwen3_next", layer_types=["full_attention"], num_hidden_layers=1,
                                          output_router_logits=True), mesh)
    seen: list[tuple[str | None, str]] = []
    for degrees in (None, (world,)):
        try:
            for local in DynamicSP(mesh, token_budget=BUDGET, cost=_cost, degrees=degrees).plan(
                    _plain_rows(TWO_BINS_OF_2, model.config.vocab_size)):
                model(**local).loss.backward()
            seen.append((None, ""))
        except Exception as e:
            seen.append((type(e).__name__, str(e)))
    return seen


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
        for what in SWITCHED:
            out[what] = z.run(_switched, what, timeout=300)
        out["router"] = z.run(_router_refusal, timeout=120)
        out["faults"] = [z.run(_fault, case, timeout=120, pg_timeout=60, strict=False) for case in FAULTS]
    return out


@pytest.mark.parametrize("mode", ["fsdp", "micro"])
def test_fsdp2_and_micro_steps_equal_the_unsharded_model(results, mode):
    for rank, res in enumerate(results["exact"]):
        loss_err, grad_err = res[mode][:2]
        assert loss_err <= LOSS_TOL, f"rank {rank} {mode}: loss off by {loss_err:.3g}"
        assert grad_err <= GRAD_TOL, f"rank {rank} {mode}: a gradient off by {grad_err:.3g}"
    assert set(results["exact"][0]["fsdp"][2]) == {1, 2, 4}


@pytest.mark.parametrize("what", SWITCHED)
def test_memory_switches_and_token_mixers_in_bins_below_sp_are_exact(results, what):
    for rank, (loss_err, grad_err, f32_rel, hist, modes) in enumerate(results[what]):
        assert set(hist) == {1, 2, 4}, f"rank {rank}: bins ran at degrees {hist}, not 1, 2 and 4"
        assert loss_err <= LOSS_TOL, f"rank {rank} {what}: loss off by {loss_err:.3g}"
        assert grad_err <= GRAD_TOL, f"rank {rank} {what}: a gradient off by {grad_err:.3g}"
        assert f32_rel <= F32_RTOL, f"rank {rank} {what}: a float32-summed gradient off by {f32_rel:.3g} (relative)"
        assert modes == SWITCHED[what], f"rank {rank}: the mixers ran in {modes}"


@pytest.mark.heavy
def test_mixer_modes_measured_inside_bins_are_exact():
    from seqpar.comm.launch import run_distributed

    for rank, (loss_err, grad_err, f32_rel, hist, modes) in enumerate(
            run_distributed(_switched, WORLD, "measured", timeout=600)):
        assert set(hist) == {1, 2, 4}, f"rank {rank}: bins ran at degrees {hist}, not 1, 2 and 4"
        assert loss_err <= LOSS_TOL and grad_err <= GRAD_TOL and f32_rel <= F32_RTOL, \
            f"rank {rank}: loss off by {loss_err:.3g}, a gradient by {grad_err:.3g}, a float32 one by {f32_rel:.3g}"
        assert set(modes.values()) <= {"state", "heads"}, f"rank {rank}: the mixers ran in {modes}"


def test_a_router_aux_loss_in_a_bin_refuses_on_every_rank(results):
    # below sp, and at the job's sp too: a bin's aux loss would be over its rows, not the step's
    for rank, (below, full) in enumerate(results["router"]):
        assert below[0] == full[0] == "Refused", (rank, below, full)
        assert "router aux loss in a dynamic SP schedule's bin of degree 2" in below[1], (rank, below)
        assert f"router aux loss in a dynamic SP schedule's bin of degree {WORLD}" in full[1], (rank, full)
        assert "--sp-schedule static" in full[1], (rank, full)


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
