"""Ring attention against the float64 reference, forward and backward, over real gloo processes
(sinks, chunked attention and MLA head dims included); its load balance, collective counts and misuse
errors; the doc-zigzag layout through a batch's SeqShard. Its pure parts (block plans, lse merge, sinks
fold): test_blocks.py. At P = 1 and 3 make test runs a covering quarter of the grid (the rest: heavy)."""


import pytest
import torch
import torch.distributed as dist

from seqpar.attention.blocks import RingStats, plan_block
from seqpar.attention.layout import layout_indices, layout_permutation, layout_seq_lens
from seqpar.attention.ring import ring_attention
from seqpar.attention.shard import SeqShard
from seqpar.attention.spec import AttnSpec
from seqpar.comm.counting import count_collectives
from seqpar.comm.launch import run_distributed
from seqpar.testing.attention_parity import (
    AttnCase,
    bad_rows,
    feature_cases,
    run_cases,
    run_rest,
)
from seqpar.testing.sampling import covering_sample, split_problems

TOL = 1e-10
LAYOUTS = ("contiguous", "zigzag")
MASKS = ("none", "pad", "packed")


def _case(seq, heads, kv, causal, mask, layout, kernel="reference", comm="p2p", **kw):
    return AttnCase(seq=seq, heads=heads, kv_heads=kv, causal=causal, mask=mask, kernel=kernel, strategy="ring",
                    options={"layout": layout, "comm": comm}, **kw)




def _doc_case(seq, heads, kv, causal, mask, kernel="reference", comm="p2p", **kw):
    return AttnCase(seq=seq, heads=heads, kv_heads=kv, causal=causal, mask=mask, kernel=kernel,
                    strategy="ring:doc-zigzag", options={"comm": comm}, **kw)


CASES = (
    # the core grid: odd lengths (incl. fewer tokens than ranks), GQA with H_kv < P, every mask and layout
    [_case(s, h, hk, c, m, lay) for s in (1, 7, 37, 129) for h, hk in ((8, 2), (6, 1)) for c in (False, True)
     for m in MASKS for lay in LAYOUTS if s < 100 or hk == 1]
    + [_case(37, 4, 4, c, m, lay) for c in (False, True) for m in MASKS for lay in LAYOUTS]
    # the fast CPU kernel
    + [_case(s, 8, 2, c, m, lay, kernel="flash_cpu") for s in (7, 129) for c in (False, True) for m in MASKS
       for lay in LAYOUTS]
    # K/V gathered once instead of passed around
    + [_case(s, 6, 1, c, m, lay, kernel=k, comm="allgather") for s, k in ((7, "reference"), (129, "flash_cpu"))
       for c in (False, True) for m in MASKS for lay in LAYOUTS]
    # sliding window (causal and two-sided), every kernel with both comms
    + [_case(s, 8, 2, c, "pad" if k == "reference" else "none", lay, kernel=k, comm=comm, window=w)
       for s, w in ((37, 5), (129, 16)) for c in (False, True) for lay in LAYOUTS
       for k in ("reference", "flash_cpu") for comm in ("p2p", "allgather")]
    # softcap and scale (reference kernel: the only one with softcap)
    + [_case(37, 8, 2, c, m, lay, softcap=2.0, scale=0.3, window=w) for c in (False, True) for m in ("pad", "packed")
       for lay in LAYOUTS for w in (None, 7)]
    # attention sinks, chunked attention, v head dim != q/k head dim (MLA)
    + feature_cases("ring")
    # doc-zigzag: documents and padding runs zigzagged one by one (many short pieces at these lengths)
    + [_doc_case(s, 6, 1, c, m) for s in (7, 37, 129) for c in (False, True) for m in MASKS]
    + [_doc_case(129, 8, 2, True, m, kernel="flash_cpu", comm=comm) for m in ("pad", "packed")
       for comm in ("p2p", "allgather")]
    + [_doc_case(37, 8, 2, True, "packed", kernel="flash_cpu", window=5),
       _doc_case(37, 8, 2, True, "pad", softcap=2.0, scale=0.3, chunk=8, sinks=True)]
)


# make test runs the whole grid at P = 2 and 4; at P = 1 (no exchange) and 3 a quarter of it that
# still meets every option value, and make verify the rest (test_rest_of_the_grid_within_tolerance)
SAMPLED = (1, 3)
SAMPLE, REST = covering_sample(CASES, 4)


def _grid(p):
    return SAMPLE if p in SAMPLED else CASES


def _balance(rank, world):
    """Causal ring at S=512 with both layouts: this rank's work counters (one forward + backward)."""
    out = {}
    for layout in LAYOUTS:
        g = torch.Generator().manual_seed(0)
        idx = layout_indices(512, world, layout)[rank]
        q, k, v = (torch.randn(1, 512, 2, 8, generator=g)[:, idx].requires_grad_(True) for _ in range(3))
        stats = RingStats()
        ring_attention(q, k, v, group=dist.group.WORLD, causal=True, layout=layout, stats=stats).sum().backward()
        out[layout] = stats
    return out


def _counts(rank, world):
    """Collectives per call: (forward, backward) counters for each comm, trusted and validated."""
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(2, 5, hh, 4, generator=g, requires_grad=True) for hh in (4, 2, 2))
    shard = SeqShard((5,) * world, layout_permutation(5 * world, world, "zigzag"))
    out = {}
    for name, kw in (("p2p", {"shard": shard, "validate": False}),
                     ("allgather", {"shard": shard, "validate": False, "comm": "allgather"}),
                     ("p2p validated", {"layout": "zigzag"})):
        with count_collectives() as fwd:
            o = ring_attention(q, k, v, group=dist.group.WORLD, causal=True, **kw)
        with count_collectives() as bwd:
            o.sum().backward()
        out[name] = (dict(fwd), dict(bwd))
    out["planning"] = _planning(rank, world, q, k, v)
    return out


def _planning(rank, world, q, k, v):
    """How often the ring plans its blocks and the kernel its rectangles over three "layers" of
    one batch (the same SeqShard), forward and backward: once for the batch, not per layer."""
    from seqpar.attention import ring_loop as ring_mod
    from seqpar.attention import varlen

    seg = torch.repeat_interleave(torch.arange(world + 1), 5)[: 5 * world].expand(2, -1)
    perm = layout_permutation(5 * world, world, "zigzag")
    shard = SeqShard((5,) * world, perm, None, seg[:, perm].contiguous())
    counts = {"plan_block": 0, "document_rects": 0}
    real_plan, real_rects = ring_mod.plan_block, varlen._document_rects

    def plan(*a):
        counts["plan_block"] += 1
        return real_plan(*a)

    def rects(*a):
        counts["document_rects"] += 1
        return real_rects(*a)

    ring_mod.plan_block, varlen._document_rects = plan, rects
    try:
        per_layer = []
        for _ in range(3):
            o = ring_attention(q, k, v, group=dist.group.WORLD, causal=True, kernel="flash_cpu", shard=shard,
                               validate=False)
            o.sum().backward()
            per_layer.append(dict(counts))
    finally:
        ring_mod.plan_block, varlen._document_rects = real_plan, real_rects
    return per_layer


def _misuse_case(name, rank, world):
    g = torch.Generator().manual_seed(rank)
    s = 5

    def inputs(h=4, hk=2, n=s):
        return tuple(torch.randn(2, n, hh, 8, generator=g, dtype=torch.float64) for hh in (h, hk, hk))

    q, k, v = inputs()
    kw = {}
    if name == "kernel without lse":
        kw["kernel"] = "sdpa"
    elif name == "softcap with flash_cpu":
        kw.update(kernel="flash_cpu", softcap=3.0)
    elif name == "heads differ on one rank" and rank == world - 1:
        q, k, v = inputs(h=8)
    elif name == "seq mismatch q vs k on one rank" and rank == 0:
        k = k[:, :3]
    elif name == "zigzag lengths":  # ranks hold other lengths than the zigzag split gives them
        lens = list(layout_seq_lens(4 * world + 1, world, "zigzag"))
        lens[0], lens[-1] = lens[0] + 1, lens[-1] - 1
        q, k, v = inputs(n=lens[rank])
        kw["layout"] = "zigzag"
    elif name == "unknown layout":
        kw["layout"] = "spiral"
    elif name == "doc-zigzag without the batch's shard":  # its permutation follows documents it cannot see
        kw.update(layout="doc-zigzag", segment_ids=torch.zeros(2, s, dtype=torch.long))
    elif name == "unknown comm":
        kw["comm"] = "carrier-pigeon"
    elif name == "dropout":
        kw["dropout"] = 0.1
    elif name == "shard of another group":
        kw["shard"] = SeqShard((s,) * (world + 1))
    elif name == "shard vs layout":
        kw.update(shard=SeqShard((s,) * world), layout="zigzag")
    return kw, q, k, v


MISUSE = {
    "kernel without lse": "ring attention needs a kernel that returns the log-sum-exp",
    "softcap with flash_cpu": "'flash_cpu' cannot honour ['softcap']",
    "heads differ on one rank": "number of query heads differs across ranks",
    "seq mismatch q vs k on one rank": "rank 0: q, k, v must share batch and local_seq_len",
    "zigzag lengths": "layout='zigzag' puts",
    "unknown layout": "unknown layout 'spiral'",
    "doc-zigzag without the batch's shard": "layout='doc-zigzag' follows the batch's documents: pass cuts=",
    "unknown comm": "unknown ring comm 'carrier-pigeon'",
    "dropout": "ring attention has no dropout",
    "shard of another group": "shard lengths for a ring of",
    "shard vs layout": "does not match the SeqShard's token positions",
}


def _misuse(rank, world):
    seen = {}
    for name in MISUSE:
        kw, q, k, v = _misuse_case(name, rank, world)
        try:
            ring_attention(q, k, v, group=dist.group.WORLD, **{"kernel": "reference", **kw})
            seen[name] = "no error"
        except ValueError as e:
            seen[name] = str(e)
        q, k, v = _misuse_case("good", rank, world)[1:]  # the group still works afterwards
        assert ring_attention(q, k, v, group=dist.group.WORLD, causal=True).shape == q.shape
    return seen


def _worker(rank, world, cases):
    return {"rows": run_cases(rank, world, cases), "balance": _balance(rank, world) if world == 4 else None,
            "counts": _counts(rank, world), "misuse": _misuse(rank, world) if world > 1 else None}


@pytest.fixture(scope="module")
def runs():
    """Every world size once (one process spawn each); the tests read what they need."""
    return {p: run_distributed(_worker, p, _grid(p), timeout=600) for p in (1, 2, 3, 4)}


@pytest.mark.distributed
@pytest.mark.parametrize("p", [1, 2, 3, 4], ids=lambda p: f"P{p}")
def test_grid_within_tolerance(runs, p):
    per_rank = runs[p]
    rows = per_rank[0]["rows"]
    assert [r["label"] for r in rows] == [c.label() for c in _grid(p)]
    bad = bad_rows(rows, TOL)
    assert not bad, f"P={p}: {len(bad)} case(s) past {TOL}: {bad[:5]}"


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("p", SAMPLED, ids=lambda p: f"P{p}")
def test_rest_of_the_grid_within_tolerance(p):
    run_rest(REST, p, TOL)


def test_sample_meets_every_option_value_and_the_rest_completes_it():
    assert len(SAMPLE) < len(CASES) // 3
    assert not split_problems(SAMPLE, REST, CASES)


def test_grid_covers_the_required_cases():
    labels = {c.label() for c in CASES}
    for s in (1, 7, 37, 129):
        for causal in (0, 1):
            for mask in MASKS:
                for lay in LAYOUTS:
                    assert f"ring/reference S={s} H=6/1 causal={causal} mask={mask} layout={lay} comm=p2p" in labels
    for kernel in ("reference", "flash_cpu"):
        for comm in ("p2p", "allgather"):
            assert any(c.kernel == kernel and c.options["comm"] == comm and c.window for c in CASES)
    assert any(c.softcap for c in CASES)
    docs = {(c.seq, c.causal, c.mask, c.kernel) for c in CASES if c.strategy == "ring:doc-zigzag"}
    assert {(s, True, m, "reference") for s in (7, 37, 129) for m in MASKS} <= docs
    assert {(129, True, m, "flash_cpu") for m in ("pad", "packed")} <= docs
    for kernel, comm in (("reference", "p2p"), ("reference", "allgather"), ("flash_cpu", "p2p")):
        of = [c for c in CASES if c.kernel == kernel and c.options.get("comm", "p2p") == comm]
        assert any(c.sinks for c in of) and any(c.chunk and c.window for c in of)
        assert {5, 12} <= {c.v_head_dim for c in of}


@pytest.mark.distributed
def test_zigzag_balances_causal_work(runs):
    p = 4
    per_rank = runs[p]
    ratio = {}
    for layout in LAYOUTS:
        work = [r["balance"][layout].visible_pairs for r in per_rank]
        ratio[layout] = max(work) / (sum(work) / p)
        assert sum(work) == 512 * 513 // 2  # every causal pair computed exactly once
        # the run counted what the pure block plans predict
        for rank, r in enumerate(per_rank):
            pos = layout_indices(512, p, layout)
            plans = [plan_block(AttnSpec(causal=True), pos[rank], pos[o]) for o in range(p)]
            assert r["balance"][layout].visible_pairs == sum(pl.visible for pl in plans if pl)
            assert r["balance"][layout].skipped == sum(pl is None for pl in plans)
    assert ratio["zigzag"] <= 1.05, ratio
    assert 1.7 <= ratio["contiguous"] <= 1.8, ratio
    # zigzag also needs no mask off the diagonal: every rank gives the kernel the same rectangles
    computed = [r["balance"]["zigzag"].computed_pairs for r in per_rank]
    assert max(computed) == min(computed)


@pytest.mark.distributed
@pytest.mark.parametrize("p", [1, 2, 3, 4], ids=lambda p: f"P{p}")
def test_collective_counts(runs, p):
    for r in runs[p]:
        c = r["counts"]
        if p == 1:
            assert c["p2p"] == ({}, {}) and c["allgather"] == ({}, {})
            continue
        # p2p: P-1 K/V hops forward; P-1 K/V hops + P dK/dV hops backward. With the batch's shard
        # the failure guard is checked once per batch: nothing in the forward (no loss here), one tiny
        # all-gather when the backward ends (a kernel failure on one rank raises on every rank)
        assert c["p2p"] == ({"batch_isend_irecv": p - 1}, {"batch_isend_irecv": 2 * p - 1, "all_gather_flat": 1})
        assert c["allgather"] == ({"all_gather_flat": 1}, {"all_gather_flat": 2, "reduce_scatter_flat": 1})
        fwd, _ = c["p2p validated"]  # checked per call: its fence ends the forward
        assert fwd == {"all_gather_flat": 2, "batch_isend_irecv": p - 1}


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3, 4], ids=lambda p: f"P{p}")
def test_blocks_are_planned_once_per_batch(runs, p):
    for r in runs[p]:
        first, *later = r["counts"]["planning"]
        assert first["plan_block"] == p and first["document_rects"] > 0
        assert all(layer == first for layer in later), r["counts"]["planning"]  # nothing planned again


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3, 4], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("name", list(MISUSE))
def test_misuse_same_error_on_every_rank(runs, p, name):
    msgs = [r["misuse"][name] for r in runs[p]]
    assert MISUSE[name] in msgs[0], msgs[0]
    assert all(m == msgs[0] for m in msgs), msgs
