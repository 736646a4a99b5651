"""Hybrid Ulysses x ring attention against the float64 reference, forward and backward, on ring x ulysses
grids of 1 to 4 gloo processes (sinks, chunked attention and MLA head dims included); the mesh
strategies; collective counts; misuse errors and kernel failures raised on every rank; the doc-zigzag
layout through a batch's SeqShard. At P = 2 make test runs a covering quarter of the grids (the rest: heavy)."""


from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from seqpar.attention.dispatch import sp_attention
from seqpar.attention.hybrid import hybrid_attention, hybrid_groups
from seqpar.attention.layout import layout_indices, layout_permutation, layout_seq_lens
from seqpar.attention.reference import reference_attention
from seqpar.attention.shard import SeqShard
from seqpar.comm.counting import count_collectives
from seqpar.comm.launch import run_distributed
from seqpar.comm.mesh import init_mesh
from seqpar.testing.attention_faults import crash_problems, crash_scenarios, run_crashes
from seqpar.testing.attention_parity import AttnCase, bad_rows, feature_cases, run_cases
from seqpar.testing.sampling import covering_sample, option_values

TOL = 1e-10
LAYOUTS = ("contiguous", "zigzag")
MASKS = ("none", "pad", "packed")


def _case(u, seq, heads, kv, causal, mask, layout, kernel="reference", comm="p2p", **kw):
    return AttnCase(seq=seq, heads=heads, kv_heads=kv, causal=causal, mask=mask, kernel=kernel, strategy="hybrid",
                    options={"ulysses": u, "layout": layout, "comm": comm}, **kw)




def _doc_grid(u):
    """doc-zigzag: documents and padding runs zigzagged over the ring, split over ulysses inside (on
    the 2x2 grid: at 2 and 3 ranks a grid is plain Ulysses or a plain ring, see test_ring.py)."""
    return ([AttnCase(seq=s, heads=6, kv_heads=2, causal=c, mask=m, strategy="hybrid:doc-zigzag",
                      options={"ulysses": u}) for s in (7, 37, 129) for c in (False, True) for m in MASKS]
            + [AttnCase(seq=129, heads=8, kv_heads=2, causal=True, mask=m, kernel="flash_cpu",
                        strategy="hybrid:doc-zigzag", options={"ulysses": u, "comm": comm})
               for m in ("pad", "packed") for comm in ("p2p", "allgather")])


def _full_grid(u):
    """Everything, for the main grids (2x2 at P=4; 1x2 and 2x1 at P=2)."""
    return (
        [_case(u, s, h, hk, c, m, lay) for s in (1, 7, 37, 129) for h, hk in ((8, 2), (6, 1)) for c in (False, True)
         for m in MASKS for lay in LAYOUTS if s < 100 or hk == 1]
        + [_case(u, s, 8, 2, c, m, lay, kernel="flash_cpu") for s in (7, 129) for c in (False, True) for m in MASKS
           for lay in LAYOUTS]
        + [_case(u, s, 6, 1, c, m, "zigzag", kernel=k, comm="allgather") for s, k in ((7, "reference"),
                                                                                        (129, "flash_cpu"))
           for c in (False, True) for m in MASKS]
        + [_case(u, 37, 8, 2, c, m, lay, kernel=k, window=5) for c in (False, True) for lay in LAYOUTS
           for k, m in (("reference", "pad"), ("flash_cpu", "none"))]
        + [_case(u, 37, 8, 2, c, "packed", lay, softcap=2.0, scale=0.3) for c in (False, True) for lay in LAYOUTS]
        # fewer query heads than ulysses ranks; GQA groups that straddle the head split
        + [_case(u, 37, h, hk, True, "pad", lay) for h, hk in ((1, 1), (3, 1), (6, 2)) for lay in LAYOUTS]
    )


def _small_grid(u):
    """The other shapes of a world size: odd lengths, GQA, masks, layouts."""
    return [_case(u, s, h, hk, c, m, lay) for s in (7, 37) for h, hk in ((6, 2), (3, 1)) for c in (False, True)
            for m in MASKS for lay in LAYOUTS if (s == 37) == (h == 6)]


def _features(u, quick=False):
    """Sinks, chunked attention and MLA head dims (feature_cases) on a ulysses=u grid."""
    return [replace(c, options={**c.options, "ulysses": u}) for c in feature_cases("hybrid", quick)]


# features on real grids: 2x2 (every kernel, both comms) and 1x3 / 3x1 (quick); at 2 ranks a grid is
# plain Ulysses or a plain ring, whose own suites run every feature case
GRIDS = {1: _small_grid(1), 2: _full_grid(2) + _full_grid(1),
         3: _small_grid(3) + _small_grid(1) + _features(3, quick=True) + _features(1, quick=True),
         4: _full_grid(2) + _small_grid(4) + _small_grid(1) + _features(2) + _doc_grid(2)}
# make test runs a quarter of P = 2's grids that still meets every option value (1 x 2 and 2 x 1 are a
# plain ring and plain Ulysses, whose own suites run every case at P = 2; the 2 x 2 grid runs whole at
# P = 4); make verify the rest (test_rest_of_p2_within_tolerance)
SAMPLE_P2, REST_P2 = covering_sample(GRIDS[2], 4)
RUN = {**GRIDS, 2: SAMPLE_P2}


def _inputs(rank, b=2, s=5, h=4, hk=2, d=8):
    g = torch.Generator().manual_seed(rank)
    return tuple(torch.randn(b, s, hh, d, generator=g, dtype=torch.float64, requires_grad=True) for hh in (h, hk, hk))


def _counts(rank, world, ug, rg):
    q, k, v = _inputs(rank)
    shard = SeqShard((5,) * world, layout_permutation(5 * world, world // 2, "zigzag", 2))
    out = {}
    for name, kw in (("trusted", {"shard": shard, "validate": False}), ("validated", {"layout": "zigzag"})):
        with count_collectives() as fwd:
            o = hybrid_attention(q, k, v, ulysses_group=ug, ring_group=rg, causal=True, **kw)
        with count_collectives() as bwd:
            o.sum().backward()
        out[name] = (dict(fwd), dict(bwd))
    return out


MISUSE = {
    "heads differ on one rank": "in the ulysses group of ring rank 1: seqpar: invalid attention input:\n"
                                "  number of query heads differs across ranks",
    "mask shape on one rank": "in the ulysses group of ring rank 0: seqpar: invalid attention input:\n"
                              "  rank 0: key_padding_mask must be [batch, local_seq_len] = [2, 5]",
    "heads differ between ulysses groups": "number of query heads differs across ranks: ['4', '8'] (rank 0..1)\n"
                                           "  (ranks counted along the ring axis",
    "kernel without lse": "ring attention needs a kernel that returns the log-sum-exp",
    "shard of another size": "the SeqShard has 3 shard lengths for ulysses=2 x ring=2",
    "zigzag lengths": "layout='zigzag' puts",
}


def _misuse(rank, world, ug, rg):
    seen = {}
    for name in MISUSE:
        q, k, v = _inputs(rank)
        kw = {"kernel": "reference"}
        if name == "heads differ on one rank" and rank == 3:
            q, k, v = _inputs(rank, h=8)
        elif name == "mask shape on one rank" and rank == 0:
            kw["key_padding_mask"] = torch.ones(2, 4, dtype=torch.bool)
        elif name == "mask shape on one rank":
            kw["key_padding_mask"] = torch.ones(2, 5, dtype=torch.bool)
        elif name == "heads differ between ulysses groups" and rank >= 2:
            q, k, v = _inputs(rank, h=8)
        elif name == "kernel without lse":
            kw["kernel"] = "sdpa"
        elif name == "shard of another size":
            kw["shard"] = SeqShard((5, 5, 5))
        elif name == "zigzag lengths":
            q, k, v = _inputs(rank, s=[6, 5, 5, 4][rank])
            kw["layout"] = "zigzag"
        try:
            hybrid_attention(q, k, v, ulysses_group=ug, ring_group=rg, **kw)
            seen[name] = "no error"
        except ValueError as e:
            seen[name] = str(e)
        q, k, v = _inputs(rank)  # the groups still work afterwards
        assert hybrid_attention(q, k, v, ulysses_group=ug, ring_group=rg, causal=True).shape == q.shape
    return seen


def _mesh_strategies(rank, world):
    """sp_attention over a ring x ulysses mesh with every strategy (zigzag shards), with chunk and
    sinks and no kernel named (an lse kernel is picked for sinks): max |err| of out and d sinks."""
    mesh = init_mesh(sp=world, ulysses=2, ring=world // 2)
    g = torch.Generator().manual_seed(5)
    s = 29
    q, k, v = (torch.randn(2, s, hh, 8, generator=g, dtype=torch.float64) for hh in (6, 2, 2))
    sinks = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    ref, _ = reference_attention(q, k, v, causal=True, window=9, chunk=12, sinks=sinks)
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (ref_dsinks,) = torch.autograd.grad(ref, sinks, grad)
    errs = {}
    for strategy, ulysses in (("ring", 1), ("hybrid", 2), ("ulysses", 1)):
        idx = layout_indices(s, world, "zigzag", ulysses=ulysses)[rank]
        shard = SeqShard(layout_seq_lens(s, world, "zigzag", ulysses), layout_permutation(s, world, "zigzag", ulysses))
        mine = sinks.detach().clone().requires_grad_(True)
        out = sp_attention(q[:, idx], k[:, idx], v[:, idx], mesh=mesh, strategy=strategy, causal=True, window=9,
                           chunk=12, sinks=mine, shard=shard)
        out.backward(grad[:, idx])
        dsinks = mine.grad.clone()
        dist.all_reduce(dsinks)  # each rank's share: the sum is the whole gradient
        errs[strategy] = max(float((out - ref.detach()[:, idx]).abs().max()), float((dsinks - ref_dsinks).abs().max()))
    return errs


def _worker(rank, world, grids):
    out = {"rows": run_cases(rank, world, grids[world])}
    if world == 4:
        ug, rg = hybrid_groups(dist.group.WORLD, 2)
        out.update(counts=_counts(rank, world, ug, rg), misuse=_misuse(rank, world, ug, rg),
                   mesh=_mesh_strategies(rank, world), crash=run_crashes(rank, world))
    return out


@pytest.fixture(scope="module")
def runs():
    """Every world size once (one process spawn each); the tests read what they need."""
    # a short process-group timeout: a rank left waiting in a collective fails fast, not in 60 s
    return {p: run_distributed(_worker, p, RUN, timeout=600, pg_timeout=20) for p in (1, 2, 3, 4)}


@pytest.mark.distributed
@pytest.mark.parametrize("p", [1, 2, 3, 4], ids=lambda p: f"P{p}")
def test_grid_within_tolerance(runs, p):
    per_rank = runs[p]
    rows = per_rank[0]["rows"]
    assert [r["label"] for r in rows] == [c.label() for c in RUN[p]]
    bad = bad_rows(rows, TOL)
    assert not bad, f"P={p}: {len(bad)} case(s) past {TOL}: {bad[:5]}"


@pytest.mark.heavy
@pytest.mark.distributed
def test_rest_of_p2_within_tolerance():
    rows = run_distributed(_worker, 2, {2: REST_P2}, timeout=900, pg_timeout=20)[0]["rows"]
    assert [r["label"] for r in rows] == [c.label() for c in REST_P2]
    bad = bad_rows(rows, TOL)
    assert not bad, f"P=2: {len(bad)} case(s) past {TOL}: {bad[:5]}"


def test_p2_sample_meets_every_option_value_and_the_rest_completes_it():
    assert len(SAMPLE_P2) + len(REST_P2) == len(GRIDS[2]) and len(SAMPLE_P2) < len(GRIDS[2]) // 3
    assert sorted(c.label() for c in SAMPLE_P2 + REST_P2) == sorted(c.label() for c in GRIDS[2])
    assert set().union(*map(option_values, SAMPLE_P2)) == set().union(*map(option_values, GRIDS[2]))


def test_grids_cover_the_required_shapes():
    # ring x ulysses: 2x2, 1x2 and 2x1, plus 1x4/4x1 and 1x3/3x1
    assert {(p, c.options["ulysses"]) for p, cases in GRIDS.items() for c in cases} == {
        (1, 1), (2, 2), (2, 1), (3, 3), (3, 1), (4, 2), (4, 4), (4, 1)}
    labels = {c.label() for c in GRIDS[4]}
    for s in (1, 7, 37, 129):
        for causal in (0, 1):
            for mask in MASKS:
                for lay in LAYOUTS:
                    assert (f"hybrid/reference S={s} H=6/1 causal={causal} mask={mask} ulysses=2 layout={lay}"
                            " comm=p2p") in labels


def test_grids_cover_doc_zigzag():
    docs = {(c.seq, c.causal, c.mask, c.kernel) for c in GRIDS[4] if c.strategy == "hybrid:doc-zigzag"}
    assert {(s, True, m, "reference") for s in (7, 37, 129) for m in MASKS} <= docs
    assert {(129, True, m, "flash_cpu") for m in ("pad", "packed")} <= docs


def test_grids_cover_the_features():
    for p, kernels in ((3, ("reference",)), (4, ("reference", "flash_cpu"))):
        for kernel in kernels:
            of = [c for c in GRIDS[p] if c.kernel == kernel]
            assert any(c.sinks for c in of) and any(c.chunk and c.window for c in of)
            assert {5, 12} <= {c.v_head_dim for c in of}


@pytest.mark.distributed
def test_kernel_failure_raises_on_every_rank_of_the_grid(runs):
    per_rank = runs[4]  # grids 4x1, 2x2 and 1x4 (2 and 3 ranks: tests/attention/test_misuse.py)
    for crash in crash_scenarios(4):
        problems = crash_problems(crash, [r["crash"][crash.label()] for r in per_rank])
        assert not problems, (crash.label(), problems)


@pytest.mark.distributed
def test_mesh_strategies(runs):
    for r in runs[4]:  # a 2 x 2 mesh
        assert set(r["mesh"]) == {"ring", "hybrid", "ulysses"} and max(r["mesh"].values()) <= TOL, r["mesh"]


@pytest.mark.distributed
def test_collective_counts(runs):
    for r in runs[4]:  # a 2 x 2 grid
        # all-to-all in and out; one K/V hop (ring of 2) forward, one K/V + two dK/dV hops backward;
        # with the batch's shard the failure guard is checked once per batch: when the backward ends,
        # one tiny all-gather over the ulysses group, one over the ring
        assert r["counts"]["trusted"] == ({"batch_isend_irecv": 3}, {"batch_isend_irecv": 5, "all_gather_flat": 2})
        # validation: ulysses group, verdicts over the ring, agreement over the ring; then the fence
        assert r["counts"]["validated"][0] == {"batch_isend_irecv": 3, "all_gather_flat": 5}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MISUSE))
def test_misuse_same_error_on_every_rank(runs, name):
    msgs = [r["misuse"][name] for r in runs[4]]  # a 2 x 2 grid
    assert MISUSE[name] in msgs[0], msgs[0]
    assert all(m == msgs[0] for m in msgs), msgs
