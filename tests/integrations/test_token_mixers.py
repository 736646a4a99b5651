"""Hybrid models under sequence parallelism (issue 13), in the run modes other than state passing
(``tests/integrations/test_state_passing.py``): Gated DeltaNet (Qwen3-Next), Mamba2 (Bamba) and
Mamba (Jamba) split by heads (forced with ``mixer_mode``), LFM2's short convolution with its halo,
whole-model parity in float64 against the same model unsharded (loss 1e-9, gradients 1e-8;
parameters the model itself sums in float32 -- its ``A_log.float()`` and float32 scans -- relative
to float32 precision, as model_parity measures), padded and packed rows, uneven shards; the gather
mode; the halo exchange against a local convolution; collectives per mixer layer; the wrapping
undone by unparallelize and followed by a deep copy.

Default run: P = 2 (one spawn). P = 1..4, zigzag / doc-zigzag, ring and hybrid: ``-m heavy``."""

import copy

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar.batch.local_batch import BATCH_KWARG
from seqpar.comm.counting import count_collectives
from seqpar.comm.halo import halo_exchange
from seqpar.comm.launch import run_distributed
from seqpar.comm.mesh import axis_group
from seqpar.integrations.mixers import GATHER, HALO, HEADS, STATE, chosen_modes, family_of, set_mixer_mode, token_mixers
from seqpar.integrations.models import decoder_config
from seqpar.testing.model_parity import (
    ModelCase,
    case_batch,
    compare_models,
    grid_floor,
    reference_grads,
    run_model_parity,
    sp_loss_scale,
    sp_meshes,
)
from seqpar.testing.zoo import VARIANTS, build_tiny

pytestmark = pytest.mark.distributed

FAMILIES = {  # the mixer -> a zoo family (tiny float64 config) that has it next to attention
    "gated-deltanet": "qwen3_next",
    "mamba2": "bamba/attention-layers",
    "mamba": "jamba/attention-layers",
    "short-conv": "lfm2/conv-layers",
}
# split by heads beyond Gated DeltaNet: Kimi delta attention, and Mamba2 mixers with two groups
# (the tiny configs have one; whole groups per rank)
SPLIT = {
    "kimi_linear": ("kimi_linear", {}),
    "bamba/one-group": ("bamba", {"attn_layer_indices": [1]}),  # heads split, the group's norm across ranks
    "jamba/channels": VARIANTS["jamba/attention-layers"],  # inner channels split, x_proj summed across ranks
    "bamba/2-groups": ("bamba", {"attn_layer_indices": [1], "mamba_n_groups": 2}),
    "nemotron_h/2-groups": ("nemotron_h", {"n_groups": 2}),
    "granitemoehybrid/2-groups": ("granitemoehybrid", {"layer_types": ["mamba", "attention"], "mamba_n_groups": 2}),
    "zamba2/2-groups": ("zamba2", {**VARIANTS["zamba2/hybrid-layers"][1], "mamba_ngroups": 2}),
}
# a projection the split cannot slice (a bias: not a per-head partial sum) -> heads does not fit, the
# mixer runs in the next mode that does (state passing), or gathered when that is forced
FALLBACK = {"qwen3_next/out_proj-bias": ("qwen3_next", "out_proj"), "jamba/x_proj-bias": ("jamba/attention-layers",
                                                                                          "x_proj")}
# (batch, sequence length, strategy, layout): lengths no P divides evenly. Default run: every mixer
# padded (Ulysses) and packed (ring on doc-zigzag: the gathered mixers put tokens back in order);
# the halo (contiguous layout) packed too.
QUICK = [("padded", 11, "ulysses", "contiguous"), ("packed", 17, "ring", "doc-zigzag")]
QUICK_HALO = [("packed", 17, "ulysses", "contiguous")]
HEAVY = [*QUICK, *QUICK_HALO, ("plain", 13, "ulysses", "zigzag"), ("padded", 16, "ring", "zigzag"),
         ("plain", 3, "ulysses", "contiguous")]  # 3 tokens at P = 3: shards shorter than the halo


def _model(family):
    if family in FALLBACK:
        base, attr = FALLBACK[family]
        model = _model(base)
        g = torch.Generator().manual_seed(5)
        for _, mixer in token_mixers(model):
            lin = getattr(mixer, attr)
            lin.bias = torch.nn.Parameter(torch.randn(lin.out_features, generator=g, dtype=lin.weight.dtype))
        return model
    model_type, overrides = SPLIT.get(family) or VARIANTS.get(family, (family, {}))
    return build_tiny(model_type, **overrides)


def _parity(rank, world, families, sizes, grid, mode=HEADS):
    """Every family x grid case at every SP size (``grid``: a list, or a dict family -> list), the
    token mixers forced to run in ``mode`` where it fits; this rank's rows."""
    torch.set_num_threads(1)
    grids = grid if isinstance(grid, dict) else {f: grid for f in families}
    meshes = {s: sp_meshes(world, sizes, s) for s in dict.fromkeys(g[2] for f in families for g in grids[f])}
    rows = []
    for family in families:
        grid = grids[family]
        model = _model(family)
        vocab = decoder_config(model.config)[0].vocab_size
        # the model's own float32 sums show when its tokens are regrouped: measured once per model over
        # packed rows and every shape of its grid (a float32 step can move one shape's sums, not another's)
        floor = grid_floor(model, vocab, (g[:2] for g in grid))
        listed = {x for _, m in token_mixers(model) for x in family_of(m).modes}
        family_mode = mode if mode in listed else None  # LFM2 lists no heads: its own choice (the halo)
        refs = {}
        for kind, seq, strategy, layout in grid:
            for p, mesh in meshes[strategy].items():
                if mesh is None or seq < p:
                    continue
                scale = sp_loss_scale(mesh)  # the oracle back-propagates at seqpar's loss scale
                if (kind, seq, scale) not in refs:
                    batch = case_batch(ModelCase(batch=kind, seq=seq), vocab)
                    refs[(kind, seq, scale)] = batch, reference_grads(model, batch, loss_scale=scale)
                batch, ref = refs[(kind, seq, scale)]
                r = compare_models(copy.deepcopy(model), batch, mesh, strategy=strategy, reference=ref, floor=floor,
                                   layout=layout, mixer_mode=family_mode)
                rows.append({"family": family, "case": (kind, seq, strategy, layout), "P": p, "float32": bool(floor),
                             **{k: r[k] for k in ("ok", "loss_diff", "grad_max", "f32_rel", "worst_param",
                                                  "mixer_modes")}})
    return rows


def _check(rows, families, sizes, grid):
    assert {(r["family"], r["P"]) for r in rows} >= {(f, p) for f in families for p in sizes}
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    # LFM2 computes in float64 throughout: compared absolutely (no float32 floor); the recurrent
    # mixers' own kernels cast to float32 (A_log.float(), float32 scans): measured, not assumed
    for r in rows:
        assert r["float32"] == (r["family"] != "lfm2/conv-layers"), r
        conv = r["family"] == FAMILIES["short-conv"]  # the halo, gathered where it does not fit (permuted, short)
        assert set(r["mixer_modes"].values()) <= ({HALO, GATHER} if conv else {HEADS}), r
    assert len(rows) >= len(families) * len(grid)


def _default_run(rank, world):
    """Everything of the default run in one spawn: parity at P = 2, the halo, the counts."""
    grids = {f: QUICK + (QUICK_HALO if f == FAMILIES["short-conv"] else []) for f in FAMILIES.values()}
    return {"parity": _parity(rank, world, list(FAMILIES.values()), (world,), grids), "halo": _halo(rank, world),
            "counts": _layer_counts(rank, world), "grouped": _parity(rank, world, list(SPLIT), (world,), QUICK),
            "approaches": {f: sorted({(HEADS in family_of(m).modes, family_of(m).split_fits(m, world))
                                      for _, m in token_mixers(_model(f))}) for f in [*SPLIT, *FALLBACK]},
            "fallback": _parity(rank, world, list(FALLBACK), (world,), QUICK),
            "gathered": _parity(rank, world, list(FALLBACK), (world,), QUICK, mode=GATHER)}


@pytest.fixture(scope="module")
def default_run():
    return run_distributed(_default_run, 2, timeout=900)


def test_hybrid_families_exact_at_p2(default_run):
    rows = default_run[0]["parity"]
    _check(rows, list(FAMILIES.values()), (2,), QUICK)
    halo = {r["case"]: r["mixer_modes"] for r in rows if r["family"] == FAMILIES["short-conv"]}
    assert halo[QUICK_HALO[0]] == {"Lfm2ShortConv": HALO}, halo


@pytest.mark.heavy
def test_hybrid_families_exact_p1_to_p4():
    # every other hybrid family runs in the zoo (P = 2, 3)
    rows = run_distributed(_parity, 4, list(FAMILIES.values()), (1, 2, 3, 4), HEAVY, timeout=1800)[0]  # rank 0
    _check(rows, list(FAMILIES.values()), (1, 2, 3, 4), HEAVY)


def test_kimi_and_mamba2_split_by_heads_exact_at_p2(default_run):
    """Kimi delta attention, Mamba2 mixers (Bamba, NemotronH, Granite hybrid, Zamba2) with two
    groups (one group per rank at P = 2) and Bamba with one group (its heads split, the group's
    gated norm summed across ranks) run split by heads and stay exact, padded and packed."""
    approaches = default_run[0]["approaches"]
    assert all(approaches[f] == [(True, True)] for f in SPLIT), approaches
    rows = default_run[0]["grouped"]
    assert {r["family"] for r in rows} == set(SPLIT) and len(rows) == len(SPLIT) * len(QUICK)
    assert all(r["ok"] and set(r["mixer_modes"].values()) == {HEADS} for r in rows), [r for r in rows if not r["ok"]]


@pytest.mark.heavy
def test_kimi_and_mamba2_split_by_heads_exact_p1_to_p4():
    """P = 3, 4: more ranks than Mamba2 groups (ranks idle but in every collective), Kimi's 4 heads
    unevenly at P = 3; uneven lengths."""
    rows = run_distributed(_parity, 4, list(SPLIT), (1, 2, 3, 4), HEAVY, timeout=1800)[0]
    assert {(r["family"], r["P"]) for r in rows} >= {(f, p) for f in SPLIT for p in (1, 2, 3, 4)}
    assert all(r["ok"] and set(r["mixer_modes"].values()) == {HEADS} for r in rows), [r for r in rows if not r["ok"]]


@pytest.mark.heavy
def test_hybrid_strategy_exact():
    rows = run_distributed(_parity, 4, list(FAMILIES.values()), (4,), [("packed", 17, "hybrid", "doc-zigzag"),
                                                                       ("padded", 15, "hybrid", "zigzag")],
                           timeout=900)[0]
    assert rows and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


# ---------------------------------------------------------------------------------------------
# the halo exchange, collectives per layer, unparallelize and deep copies
# ---------------------------------------------------------------------------------------------

def _halo(rank, world):
    """A causal depthwise convolution of width k on uneven shards: halo + shard vs the whole
    sequence, forward and input gradient."""
    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    group = axis_group(mesh, "sp")
    g = torch.Generator().manual_seed(0)
    errors = []
    for s, k in ((13, 3), (9, 4), (world * 2, 3)):
        x = torch.randn(2, s, 5, generator=g, dtype=torch.float64)
        w = torch.randn(5, 1, k, generator=g, dtype=torch.float64)
        cot = torch.randn(2, s, 5, generator=g, dtype=torch.float64)

        def conv(t, w=w, k=k):  # [B, T, C] -> [B, T, C], causal
            return F.conv1d(F.pad(t.transpose(1, 2), (k - 1, 0)), w, groups=5).transpose(1, 2)

        ref_x = x.clone().requires_grad_()
        (conv(ref_x) * cot).sum().backward()
        pieces = torch.tensor_split(torch.arange(s), world)
        mine = pieces[rank]
        local = x[:, mine].clone().requires_grad_()
        halo = halo_exchange(local, k - 1, dim=1, group=group)
        out = conv(torch.cat([halo, local], dim=1))[:, halo.shape[1]:]  # rank 0: zero-padded start, as unsharded
        (out * cot[:, mine]).sum().backward()
        errors.append(max(float((out - conv(x)[:, mine]).abs().max()),
                          float((local.grad - ref_x.grad[:, mine]).abs().max()), 0.0 if rank else float(halo.numel())))
    return errors


def test_halo_exchange_matches_the_whole_sequence(default_run):
    for res in default_run:
        assert max(res["halo"]) <= 1e-12, res["halo"]


@pytest.mark.heavy
def test_halo_exchange_uneven_p3():
    for errors in run_distributed(_halo, 3, timeout=300):
        assert max(errors) <= 1e-12, errors


def _layer_counts(rank, world):
    """Collectives of one mixer layer's forward and backward (called directly with the batch), and
    of a whole Qwen3-Next forward; the wrapping after unparallelize and in a deep copy (bound to the
    copy, and undone by unparallelizing the copy without touching the original)."""
    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    out = {}
    two_gdn = {"layer_types": ["linear_attention", "linear_attention", "full_attention"], "num_hidden_layers": 3}
    for family in ("qwen3_next", "lfm2/conv-layers"):
        model = build_tiny("qwen3_next", **two_gdn) if family == "qwen3_next" else _model(family)
        seqpar.parallelize(model, mesh)
        if family == "qwen3_next":
            set_mixer_mode(model, HEADS)
        batch = case_batch(ModelCase(batch="padded", seq=11), decoder_config(model.config)[0].vocab_size)
        local = seqpar.shard_batch(batch, mesh)
        _, mixer = token_mixers(model)[0]
        x = torch.randn(2, local["input_ids"].shape[1], model.config.hidden_size, dtype=torch.float64,
                        requires_grad=True)
        rule_heads = []  # Gated DeltaNet: (value heads, tokens) of each call of the model's scan
        if family == "qwen3_next":
            import transformers.models.qwen3_next.modeling_qwen3_next as qn

            scan = qn.torch_chunk_gated_delta_rule

            def counted(q, k, v, *args, _seen=rule_heads, _scan=scan, **kwargs):
                _seen.append((v.shape[2], v.shape[1]))
                return _scan(q, k, v, *args, **kwargs)

            qn.torch_chunk_gated_delta_rule = counted
        with count_collectives() as fwd:
            y = mixer(x, seqpar_batch=local[BATCH_KWARG])
        if family == "qwen3_next":
            qn.torch_chunk_gated_delta_rule = scan
        with count_collectives() as bwd:
            y.sum().backward()
        with count_collectives() as whole_fwd:
            loss = model(**local).loss
        with count_collectives() as whole_bwd:
            loss.backward()
        ran = chosen_modes(model)[type(mixer).__name__]
        copied = copy.deepcopy(model)
        bound_to_copy = all(m.forward.__self__ is m for _, m in token_mixers(copied))
        seqpar.unparallelize(copied)  # the copy's undo unwraps the copy's modules, not the original's
        copy_undone = (all("forward" not in vars(m) for _, m in token_mixers(copied))
                       and all("forward" in vars(m) for _, m in token_mixers(model)))
        seqpar.unparallelize(model)
        mixers = len(token_mixers(model))
        out[family] = {"approach": ran, "fwd": dict(fwd), "bwd": dict(bwd), "scan": rule_heads,
                       "heads": (mixer.num_v_heads, local["input_ids"].shape[1]) if family == "qwen3_next" else None,
                       "whole": (dict(whole_fwd), dict(whole_bwd)), "layers": mixers,
                       "attention": len(model.config.layer_types) - mixers, "copy": bound_to_copy and copy_undone,
                       "unwrapped": all("forward" not in vars(m) for _, m in token_mixers(model))}
    return out


def test_collectives_per_mixer_layer(default_run):
    for res in default_run:
        out = res["counts"]
        gdn, conv = out["qwen3_next"], out["lfm2/conv-layers"]
        assert gdn["approach"] == HEADS and conv["approach"] == HALO
        # heads: the input all-gathered and the partial outputs reduce-scattered, each way
        assert gdn["fwd"] == gdn["bwd"] == {"all_gather_flat": 1, "reduce_scatter_flat": 1}, gdn
        # halo: one batch of point-to-point transfers each way (k - 1 tokens)
        assert conv["fwd"] == {"batch_isend_irecv": 1} and conv["bwd"] == {"batch_isend_irecv": 1}, conv
        # whole models: per attention layer Ulysses' 2 exchanges each way, the loss's all-reduce
        # and the backward's one failure check (test_hf); per mixer layer the above; this is the
        # model's first forward, so also its one strategy agreement (test_hf); Qwen3-Next is a MoE whose
        # router logits the zoo turns on: one more all-reduce each way, of the router statistics
        for r, router in ((gdn, 1), (conv, 0)):
            a, m = r["attention"], r["layers"]
            by_heads = r["approach"] == HEADS
            fwd, bwd = r["whole"]
            assert fwd == {"batch_isend_irecv": 2 * a + (0 if by_heads else m), "all_reduce": 1 + router,
                           "all_gather_flat": 1 + by_heads * m, **({"reduce_scatter_flat": m} if by_heads else {})}, r
            assert bwd == {"batch_isend_irecv": 2 * a + (0 if by_heads else m), "all_gather_flat": 1 + by_heads * m,
                           **({"reduce_scatter_flat": m} if by_heads else {}),
                           **({"all_reduce": 1} if router else {})}, r
            assert r["copy"] and r["unwrapped"], r
        assert (gdn["layers"], gdn["attention"], conv["layers"], conv["attention"]) == (2, 1, 1, 1)


@pytest.mark.heavy
def test_builtin_hybrids_with_activation_checkpointing():
    """The built-in hybrids (seqpar verify / train --model) recompute their layers in the backward:
    the mixers' collectives (split by heads, state passing) run again there, in the same order on
    every rank."""
    cases = [ModelCase(model=m, batch=b, seq=s, checkpointing=c, mixer_mode=mode)
             for m in ("tiny-qwen3-next", "tiny-bamba") for mode in (HEADS, STATE)
             for b, s, c in (("packed", 17, "non-reentrant"), ("padded", 15, "reentrant"))]
    rows = run_distributed(run_model_parity, 4, cases, (2, 4), timeout=1200)[0]
    assert len(rows) == 2 * len(cases) and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


def test_gated_deltanet_splits_its_heads(default_run):
    """The heads approach: each rank's scan runs the whole sequence for its share of the value
    heads only; over the ranks every head runs once (not P times, as a gather would)."""
    scans = [res["counts"]["qwen3_next"]["scan"] for res in default_run]
    heads = default_run[0]["counts"]["qwen3_next"]["heads"][0]
    seq = sum(res["counts"]["qwen3_next"]["heads"][1] for res in default_run)
    assert all(len(s) == 1 for s in scans), scans  # padded rows: one call over the batch
    assert sum(h for s in scans for h, _ in s) == heads and all(h < heads for s in scans for h, _ in s), scans
    assert all(t == seq for s in scans for _, t in s), scans  # each over the whole sequence


def test_unsliceable_mixer_runs_in_another_mode_and_exact(default_run):
    """A split mixer with a biased projection (Qwen3-Next's out_proj, Jamba's x_proj) does not fit
    the split: asked for heads it runs in the next mode that fits (state passing, which slices
    nothing), asked for gather it runs gathered; both exact."""
    approaches = default_run[0]["approaches"]
    assert all(approaches[f] == [(True, False)] for f in FALLBACK), approaches
    for key, mode in (("fallback", STATE), ("gathered", GATHER)):
        rows = default_run[0][key]
        assert {r["family"] for r in rows} == set(FALLBACK) and len(rows) == len(FALLBACK) * len(QUICK)
        assert all(r["ok"] and set(r["mixer_modes"].values()) == {mode} for r in rows), rows
