"""Every transformer class the installed diffusers ships, sequence-parallel against itself unsharded
(seqpar.testing.diffusers_zoo): tiny float64 configs with token and head counts that do not divide P,
Ulysses and ring, the drop-in call (whole output) and the sharded one (the loss per shard). Each class
must end exact or refused with its reason: a mismatch (silently wrong), a crash or a class the zoo
could not build fails, and so does a class that is neither declared nor refused (a new diffusers
release's), before anything runs.

`make test` runs the P=2 sweep: Flux, SD3 and Wan (issue 47's done-when) under every strategy and
call, every other class under one (strategy, call) pair in turn. `make verify` (heavy) runs the
whole grid at P=2 and at P=3."""

import pytest

from seqpar.comm.launch import run_distributed
from seqpar.integrations.diffusers.families import FAMILIES
from seqpar.integrations.diffusers.refused import REFUSED
from seqpar.testing.diffusers_specs import SPECS
from seqpar.testing.diffusers_zoo import OUTPUTS, dit_classes, run_dit_zoo

DONE_WHEN = ("FluxTransformer2DModel", "SD3Transformer2DModel", "WanTransformer3DModel")
STRATEGIES = ("ulysses", "ring")


def test_every_class_is_declared_or_refused():
    """No processes: a class diffusers adds fails here until it is declared (families.py, with a tiny
    spec) or refused with its reason (refused.py)."""
    classes = set(dit_classes())
    assert len(classes) >= 70, len(classes)  # enumerated from diffusers, not a hand-picked list
    assert classes == set(FAMILIES) | set(REFUSED), sorted(classes ^ (set(FAMILIES) | set(REFUSED)))
    assert not set(FAMILIES) & set(REFUSED)
    assert set(SPECS) == set(FAMILIES)  # every declared class has its tiny config and inputs
    assert all(len(why) > 60 for why in REFUSED.values())


@pytest.fixture(scope="module", params=["P=2 sweep", pytest.param("P=2", marks=pytest.mark.heavy),
                                        pytest.param("P=3", marks=pytest.mark.heavy)])
def zoo(request):
    p = int(request.param[2])
    every = set(DONE_WHEN) if request.param.endswith("sweep") else None
    rows = run_distributed(run_dit_zoo, p, None, STRATEGIES, OUTPUTS, every, timeout=2400)[0]
    return p, every, rows


def test_every_class_ends_exact_or_refused(zoo):
    p, every, rows = zoo
    assert {r.name for r in rows} == set(dit_classes())
    bad = [f"{r.name} {r.strategy} {r.output}: {r.outcome} ({r.detail[:300]})" for r in rows
           if r.outcome not in ("exact", "refused")]
    assert not bad, "\n".join(bad)
    assert {r.name for r in rows if r.outcome == "exact"} == set(FAMILIES)
    assert {r.name for r in rows if r.outcome == "refused"} == set(REFUSED)
    ran = {(r.strategy, r.output) for r in rows if r.outcome == "exact"}
    assert ran == {(s, o) for s in STRATEGIES for o in OUTPUTS}  # every strategy and call ran
    if every is None:  # the whole grid: every declared class under every strategy and call
        for name in FAMILIES:
            assert len([r for r in rows if r.name == name]) == len(STRATEGIES) * len(OUTPUTS), name
    assert all(r.p == p for r in rows)


def test_flux_sd3_and_wan_are_exact_both_ways(zoo):
    """Issue 47's done-when: drop-in and sharded, Ulysses and ring, uneven tokens (and heads), loss
    within 1e-9 and every gradient within 1e-8 after sync_gradients."""
    _, _, rows = zoo
    for name in DONE_WHEN:
        mine = {(r.strategy, r.output): r for r in rows if r.name == name}
        assert set(mine) == {(s, o) for s in STRATEGIES for o in OUTPUTS}, (name, set(mine))
        for r in mine.values():
            assert r.outcome == "exact" and r.loss_diff <= 1e-9 and r.grad_max <= 1e-8, r


def test_refusals_name_the_class_and_the_reason(zoo):
    _, _, rows = zoo
    for r in rows:
        if r.outcome == "refused":
            assert r.name in r.detail and r.detail.startswith("seqpar does not parallelize"), r
            assert REFUSED[r.name] in r.detail, r
