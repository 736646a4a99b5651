"""State passing (issue 28): the pieces of a batch (pure), the float64 scans against transformers'
kernels, each family's kernel entry points, the state-passing kernels forward and backward on P =
1..4 ranks simulated in one process (threads, an in-process all-gather) against each document run
alone, and on gloo: collectives and bytes per layer, the measured mode choice; whole models against
float64 oracles at P = 1..4 in the heavy grid (P = 2 also in the zoo)."""

import importlib.metadata

import pytest
import torch

from seqpar.attention.layout import document_cuts, layout_permutation, layout_seq_lens
from seqpar.attention.shard import SeqShard
from seqpar.compat import CHECKED_ON, calls_kernels
from seqpar.integrations.hf.features import MIXER_MODELING
from seqpar.integrations.mixers import HANDLED_MIXERS, STATE, family_of
from seqpar.integrations.mixers.pieces import piece_plan
from seqpar.testing import scans64

# ---------------------------------------------------------------------------------------------
# pieces: a property check against the original token order, over layouts and batches
# ---------------------------------------------------------------------------------------------


def _shard(seq, p, layout, segments=None, keep=None, ulysses=1):
    cuts = document_cuts(segments, keep) if layout == "doc-zigzag" else None
    perm = None if layout == "contiguous" else layout_permutation(seq, p, layout, ulysses, cuts)

    def in_layout(t):
        return None if t is None or perm is None else t.index_select(1, perm)

    return SeqShard(layout_seq_lens(seq, p, layout, ulysses, cuts), perm,
                    keep if perm is None else in_layout(keep), segments if perm is None else in_layout(segments))


def _docs(lengths, pad=0):
    """One packed row: segment ids of documents of ``lengths``, then ``pad`` padding tokens."""
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), len(lengths))])
    keep = torch.ones(seg.numel(), dtype=torch.bool)
    if pad:
        keep[-pad:] = False
    return seg, keep


def _check_plan(shard, rows, segments, keep, widths=(1, 2, 3)):
    """Pieces cover every row's tokens (packed: its real ones) once, each consecutive in the original
    order and in its rank's shard, inside one document; ``pred`` is the piece ending just before,
    in the same document; levels follow preds; the halo index finds each piece's preceding inputs."""
    plan = piece_plan(shard, rows)
    offsets = [sum(shard.seq_lens[:r]) for r in range(len(shard.seq_lens))]
    s = sum(shard.seq_lens)

    def orig(rank, local):
        i = offsets[rank] + local
        return i if shard.positions is None else int(shard.positions[i])

    def doc(b, o):  # the document of original token o, None for padding
        if keep is not None and segments is not None and not keep[b, o]:
            return None
        return 0 if segments is None else int(segments[b, o])

    covered = set()
    for rank, pieces in enumerate(plan.by_rank):
        for j, piece in enumerate(pieces):
            flat = plan.offsets[rank] + j
            assert plan.flat[flat] is piece
            tokens = [orig(rank, piece.start + t) for t in range(piece.length)]
            assert tokens == list(range(piece.origin, piece.end)), (rank, piece, tokens)
            assert len({doc(piece.row, o) for o in tokens}) == 1 and doc(piece.row, piece.origin) is not None
            covered |= {(piece.row, o) for o in tokens}
            starts = piece.origin == 0 or doc(piece.row, piece.origin - 1) != doc(piece.row, piece.origin)
            if starts:
                assert piece.pred == -1, piece
            else:
                pred = plan.flat[piece.pred]
                assert pred.row == piece.row and pred.end == piece.origin, (piece, pred)
    assert covered == {(b, o) for b in range(rows) for o in range(s) if doc(b, o) is not None}
    # sent: exactly the pieces some piece continues, each on another rank than its successor
    preds = {p.pred for p in plan.flat if p.pred >= 0}
    sent = [plan.offsets[r] + j for r in range(len(plan.by_rank)) for j in plan.sent[r]]
    assert sorted(sent) == sorted(preds) and [plan.row[i] for i in sent] == list(range(len(sent)))
    owner = {plan.offsets[r] + j: r for r, pieces in enumerate(plan.by_rank) for j in range(len(pieces))}
    assert all(owner[p.pred] != owner[i] for i, p in enumerate(plan.flat) if p.pred >= 0)
    depth = {i: d for d, level in enumerate(plan.levels) for i in level}
    assert sorted(depth) == sorted(sent)
    assert all((plan.flat[i].pred < 0) == (depth[i] == 0) and (plan.flat[i].pred < 0
               or depth[plan.flat[i].pred] == depth[i] - 1) for i in sent)
    for h in widths:  # tails hold original index + 1 (0: before a piece's start, or the zero row)
        tails = [o + 1 if o >= plan.flat[i].origin else 0 for i in sent
                 for o in range(plan.flat[i].end - h, plan.flat[i].end)]
        table = torch.tensor([*tails, 0])
        for rank in range(len(plan.by_rank)):
            got = table[torch.tensor(plan.halo_index(rank, h), dtype=torch.long).view(-1, h)].tolist()
            for piece, row in zip(plan.by_rank[rank], got, strict=True):
                first = piece.origin
                while first > 0 and doc(piece.row, first - 1) == doc(piece.row, piece.origin):
                    first -= 1  # the document's first token
                assert row == [o + 1 if o >= first else 0 for o in range(piece.origin - h, piece.origin)], (piece, row)
    return plan


@pytest.mark.parametrize("seq,p,layout,ulysses", [(10, 1, "contiguous", 1), (10, 3, "contiguous", 1),
                                                  (3, 3, "contiguous", 1), (13, 2, "zigzag", 1),
                                                  (13, 3, "zigzag", 1), (17, 4, "zigzag", 2), (16, 4, "zigzag", 1)])
def test_pieces_of_unpacked_rows(seq, p, layout, ulysses):
    plan = _check_plan(_shard(seq, p, layout, ulysses=ulysses), 2, None, None)
    if layout == "contiguous":  # one piece per row and rank, chained rank after rank
        assert [len(r) for r in plan.by_rank] == [2] * p and len(plan.levels) == p - 1
        assert plan.counts == (2,) * (p - 1) + (0,)  # the last rank passes nothing on


def test_pieces_of_padded_rows_keep_the_padding():
    keep = torch.ones(2, 11, dtype=torch.bool)
    keep[1, 7:] = False
    shard = _shard(11, 3, "zigzag", keep=keep)
    plan = _check_plan(shard, 2, None, None)  # whole rows, padding included: the model runs them so
    assert sum(p.length for p in plan.flat) == 22


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "doc-zigzag"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_pieces_of_packed_rows(layout, p):
    rows = [_docs([5, 7, 5]), _docs([8, 4], pad=5)]  # documents across ranks; padding at the end
    seg = torch.stack([r[0] for r in rows])
    keep = torch.stack([r[1] for r in rows])
    plan = _check_plan(_shard(17, p, layout, seg, keep), 2, seg, keep)
    assert sum(p.pred < 0 for p in plan.flat) == 5  # one chain per document
    if layout == "contiguous":  # at most one piece per row and rank boundary crosses
        assert sum(plan.counts) <= 2 * (p - 1), plan.counts


def test_pieces_are_kept_per_batch():
    shard = _shard(12, 2, "zigzag")
    assert piece_plan(shard, 2) is piece_plan(shard, 2)


# ---------------------------------------------------------------------------------------------
# the float64 scans are the models' kernels (same math), and each family's kernels are found
# ---------------------------------------------------------------------------------------------

def _modeling(name):
    import importlib

    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _gdn_inputs(g_per_channel, b=2, t=19, hk=2, h=4, k=5, v=6, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g = -torch.rand(b, t, h, *((k,) if g_per_channel else ()), generator=gen, dtype=torch.float64)
    return (rnd(b, t, hk, k), rnd(b, t, hk, k), rnd(b, t, h, v)), {
        "g": g, "beta": torch.rand(b, t, h, generator=gen, dtype=torch.float64), "use_qk_l2norm_in_kernel": True,
        "initial_state": rnd(b, h, k, v), "output_final_state": True}


def _close32(a, b):
    """Equal to float32 precision, relative to the larger entry."""
    return float((a - b).abs().max()) <= 1e-5 * max(float(b.abs().max()), 1.0)


def test_float64_delta_rules_are_the_models_kernels():
    args, kw = _gdn_inputs(False)
    ref = _modeling("qwen3_next").torch_chunk_gated_delta_rule(*args, **kw)
    got = scans64.gated_delta_rule(*args, **kw)
    assert got[0].dtype == torch.float64 and _close32(got[0], ref[0]) and _close32(got[1], ref[1])
    args, kw = _gdn_inputs(True, hk=4)
    ref = _modeling("kimi_linear").chunk_kimi_delta_attention(*args, **kw)
    got = scans64.kimi_delta_rule(*args, **kw)
    assert _close32(got[0], ref[0]) and _close32(got[1], ref[1])


def _mamba2_inputs(b=2, t=19, h=4, p=3, g=2, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return (rnd(b, t, h, p), rnd(b, t, h), -torch.rand(h, generator=gen) - 0.3, rnd(b, t, g, n), rnd(b, t, g, n)), {
        "chunk_size": 8, "D": rnd(h), "dt_bias": rnd(h), "initial_states": rnd(b, h, p, n), "dt_softplus": True,
        "dt_limit": (0.0, float("inf")), "return_final_states": True}


def _mamba_inputs(b=2, t=19, i=6, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return (rnd(b, i, t), rnd(b, i, t), -torch.rand(i, n, generator=gen) - 0.3, rnd(b, n, t), rnd(b, n, t)), {
        "D": rnd(i), "z": rnd(b, i, t), "delta_bias": rnd(i), "delta_softplus": True, "return_last_state": True}


def test_float64_mamba_scans_are_the_models_kernels():
    args, kw = _mamba2_inputs()
    ref, got = _modeling("bamba").mamba2_chunk_scan(*args, **kw), scans64.mamba2_scan(*args, **kw)
    assert _close32(got[0], ref[0]) and _close32(got[1], ref[1])
    args, kw = _mamba_inputs()
    ref, got = _modeling("jamba").mamba_selective_scan(*args, **kw), scans64.selective_scan(*args, **kw)
    assert _close32(got[0], ref[0]) and _close32(got[1], ref[1])


MIXER_MODULES = MIXER_MODELING  # each state-passing class -> its modeling module's model type


def test_every_recurrent_family_runs_state_passing():
    """Every class issue 28 names lists ``"state"``; the rest (in attention-free models, which
    parallelize refuses) are the only ones gathered."""
    stated = {name for name, f in HANDLED_MIXERS.items() if STATE in f.modes}
    assert stated == set(MIXER_MODULES), stated ^ set(MIXER_MODULES)
    gathered = {name for name, f in HANDLED_MIXERS.items() if f.modes[0] == "gather"}
    assert gathered == {"Mamba2Mixer", "MambaMixer", "FalconMambaMixer"}, gathered


@pytest.mark.parametrize("cls", sorted(MIXER_MODULES))
def test_each_family_calls_the_kernels_it_declares(cls):
    """compat: the class's forward still reaches its declared convolution, scan and fused names as
    globals of its modeling module (5.24: from forward; 5.25: the convolution, Mamba's and Mamba2's
    scans through a helper of the same file, e.g. causal_conv1d_forward)."""
    module = _modeling(MIXER_MODULES[cls])
    kernels = HANDLED_MIXERS[cls].state
    assert calls_kernels(getattr(module, cls), kernels.names)
    assert not calls_kernels(getattr(module, cls), ("a_kernel_it_does_not_call",))


def test_family_of_recurrent_mixers():
    from seqpar.testing.zoo import build_tiny

    model = build_tiny("qwen3_next", layer_types=["linear_attention", "full_attention"], num_hidden_layers=2)
    families = {family_of(m).name for m in model.modules() if family_of(m) is not None}
    assert families == {"Gated DeltaNet (Qwen3-Next)"}


# ---------------------------------------------------------------------------------------------
# whole models on gloo: float64 parity with float64 scans, the models' own float32 scans, counts
# ---------------------------------------------------------------------------------------------

FAMILIES = {  # every family issue 28 names -> a zoo model (tiny, float64) with it next to attention
    "qwen3_next": "Qwen3NextGatedDeltaNet", "qwen3_5_text": "Qwen3_5GatedDeltaNet",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet", "kimi_linear": "KimiLinearDeltaAttention",
    "bailing_hybrid": "BailingHybridDeltaAttention", "bamba/attention-layers": "BambaMixer",
    "nemotron_h": "NemotronHMamba2Mixer", "zamba2/hybrid-layers": "Zamba2MambaMixer",
    "granitemoehybrid/attention-layers": "GraniteMoeHybridMambaLayer", "falcon_h1": "FalconH1Mixer",
    "jamba/attention-layers": "JambaMambaMixer", "zamba": "ZambaMambaMixer",
}
QUICK_FAMILIES = ["qwen3_next", "kimi_linear", "bamba/attention-layers", "jamba/attention-layers"]  # one per scan
# (batch, length, strategy, layout): lengths no P divides; packed rows hold documents that span ranks
QUICK = [("padded", 11, "ulysses", "contiguous"), ("packed", 17, "ring", "doc-zigzag")]
HEAVY = [*QUICK, ("plain", 13, "ulysses", "zigzag"), ("padded", 16, "ring", "zigzag"),
         ("packed", 19, "ulysses", "contiguous"), ("plain", 3, "ulysses", "contiguous")]  # 1-token shards at P = 3


def _model(family):
    from seqpar.testing.zoo import VARIANTS, build_tiny

    model_type, overrides = VARIANTS.get(family, (family, {}))
    return build_tiny(model_type, **overrides)


def _sp_grads(model, batch, mesh, strategy, layout, mode):
    """Loss and synced gradients of a parallelized deep copy of ``model`` in mixer mode ``mode``,
    and the modes its mixers ran in."""
    import copy

    import seqpar
    from seqpar.integrations.mixers import chosen_modes, set_mixer_mode

    sp = copy.deepcopy(model)
    seqpar.parallelize(sp, mesh, strategy=strategy)
    try:
        set_mixer_mode(sp, mode)
        loss = sp(**seqpar.shard_batch(batch, mesh, layout=layout)).loss
        loss.backward()
        seqpar.sync_gradients(sp, mesh)
        modes = chosen_modes(sp)
    finally:
        seqpar.unparallelize(sp)
    return float(loss.detach()), {n: q.grad for n, q in sp.named_parameters()}, modes


def _diff(a, b):
    if a is None and b is None:
        return 0.0
    a, b = (x if x is not None else torch.zeros_like(y) for x, y in ((a, b), (b, a)))
    return float((a - b).abs().max())


def _sp_only(world, sizes, strategy):
    """For each SP size a mesh of the first P ranks without data parallelism (the others sit it
    out): dp replicas would scale each one's gradients by 1 / dp before the model's own float32
    casts round them, which moves them by float32 rounding -- the dp x sp meshes are checked at
    float32 precision elsewhere (test_token_mixers, the zoo)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from seqpar.testing.model_parity import sp_meshes

    if strategy == "hybrid":
        assert sizes == (world,), "the hybrid strategy's 2-D mesh here spans the world"
        return sp_meshes(world, sizes, strategy)
    out = {}
    for p in sizes:  # every rank builds every mesh (its groups are made together)
        mesh = DeviceMesh("cpu", torch.arange(p), mesh_dim_names=("sp",))
        out[p] = mesh if dist.get_rank() < p else None
    return out


def _strict_rows(rank, world, families, sizes, grid, mode="state"):
    """With float64 scans (:mod:`seqpar.testing.scans64`) every family x case x SP size: the loss
    within 1e-9 and every gradient within 1e-8 of the unsharded model's, except the parameters the
    model itself sums in float32 (its ``A_log.float()``, float32 norms and routers: measured by
    precision_floor), those within float32 precision (F32_RTOL, relative). This rank's rows."""
    from seqpar.integrations.models import decoder_config
    from seqpar.testing.model_parity import (
        F32_RTOL,
        GRAD_TOL,
        LOSS_TOL,
        ModelCase,
        case_batch,
        grid_floor,
        reference_grads,
        sp_loss_scale,
    )
    from seqpar.testing.scans64 import float64_scans

    torch.set_num_threads(1)
    meshes = {s: _sp_only(world, sizes, s) for s in dict.fromkeys(g[2] for g in grid)}
    rows = []
    for family in families:
        model = _model(family)
        vocab = decoder_config(model.config)[0].vocab_size
        with float64_scans(model):
            # every shape of the grid: a float32 step can move the loss under one shape and not another
            floor = grid_floor(model, vocab, (g[:2] for g in grid))
            refs = {}
            for kind, seq, strategy, layout in grid:
                batch = case_batch(ModelCase(batch=kind, seq=seq), vocab)
                for p, mesh in meshes[strategy].items():
                    if mesh is None or seq < p:
                        continue
                    scale = sp_loss_scale(mesh)  # the oracle back-propagates at seqpar's loss scale
                    if (kind, seq, scale) not in refs:
                        refs[(kind, seq, scale)] = reference_grads(model, batch, loss_scale=scale)
                    ref_loss, ref = refs[(kind, seq, scale)]
                    loss, grads, modes = _sp_grads(model, batch, mesh, strategy, layout, mode)
                    strict = max((_diff(grads[n], ref[n]) for n in ref if n not in floor.params), default=0.0)
                    f32 = max((_diff(grads[n], ref[n]) / max(float(ref[n].abs().max()), 1e-30) for n in ref
                               if n in floor.params and _diff(grads[n], ref[n]) > GRAD_TOL), default=0.0)
                    # a model with float32 steps of its own (a non-empty floor) is held to float32
                    # precision wherever they feed: the floor's regrouping misses gradients upstream of a
                    # float32 norm that only a new token order perturbs (NemotronH under zigzag: the
                    # embeddings and layer 0's in_proj at 6e-8, float32's unit in the last place)
                    upstream = 0.0
                    if floor.params and strict > GRAD_TOL:
                        upstream = max(_diff(grads[n], ref[n]) / max(float(ref[n].abs().max()), 1e-30) for n in ref
                                       if n not in floor.params and _diff(grads[n], ref[n]) > GRAD_TOL)
                    strict_ok = strict <= GRAD_TOL or (floor.params and upstream <= F32_RTOL)
                    loss_tol = max(LOSS_TOL, F32_RTOL * abs(ref_loss)) if floor.loss else LOSS_TOL
                    rows.append({"family": family, "case": (kind, seq, strategy, layout), "P": p, "modes": modes,
                                 "loss_diff": abs(loss - ref_loss), "strict": strict, "f32_rel": f32,
                                 "upstream_f32_rel": upstream,
                                 "ok": abs(loss - ref_loss) <= loss_tol and strict_ok and f32 <= F32_RTOL})
    return rows


def _check_strict(rows, families, sizes, grid, mode="state"):
    assert {(r["family"], r["P"]) for r in rows} >= {(f, p) for f in families for p in sizes}, rows
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
    assert all(r["modes"] == {FAMILIES[r["family"]]: mode} for r in rows), [r["modes"] for r in rows]


def _as_shipped(rank, world, families, grid):
    """The models' own float32 scans (transformers' torch code) under state passing, against the
    float64 truth (float64 scans, unsharded): the sharded model's largest relative error over the
    loss and every gradient, and the unsharded float32 model's own (state passing regroups the
    scans' float32 rounding and must add no error of its own beyond that)."""
    from seqpar.integrations.models import decoder_config
    from seqpar.testing.model_parity import ModelCase, case_batch, reference_grads, sp_meshes
    from seqpar.testing.scans64 import float64_scans

    torch.set_num_threads(1)

    def rel(loss, grads, truth_loss, truth):
        return max(abs(loss - truth_loss) / abs(truth_loss),
                   *(_diff(grads[n], truth[n]) / max(float(truth[n].abs().max()), 1e-30) for n in truth
                     if truth[n] is not None))

    rows = []
    for family in families:
        model = _model(family)
        vocab = decoder_config(model.config)[0].vocab_size
        for kind, seq, strategy, layout in grid:
            batch = case_batch(ModelCase(batch=kind, seq=seq), vocab)
            with float64_scans(model):
                truth_loss, truth = reference_grads(model, batch)
            mesh = sp_meshes(world, (world,), strategy)[world]
            loss, grads, modes = _sp_grads(model, batch, mesh, strategy, layout, "state")
            rows.append({"family": family, "case": (kind, seq, strategy, layout), "modes": modes,
                         "sharded": rel(loss, grads, truth_loss, truth),
                         "own": rel(*reference_grads(model, batch), truth_loss, truth)})
    return rows


def _layer_counts(rank, world):
    """Collectives and their bytes of one state-passing mixer layer, forward and backward, at two
    sequence lengths (contiguous rows and packed zigzag rows); whole-model forward / backward
    counts of a Qwen3-Next with two Gated DeltaNet layers; Zamba (one scan call per Mamba head)."""
    import seqpar
    from seqpar.batch.local_batch import BATCH_KWARG
    from seqpar.comm.counting import count_collective_bytes, count_collectives
    from seqpar.integrations.mixers import describe_token_mixers, set_mixer_mode, token_mixers
    from seqpar.integrations.models import decoder_config
    from seqpar.testing.model_parity import ModelCase, case_batch
    from seqpar.testing.zoo import build_tiny

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    out = {}
    two = {"layer_types": ["linear_attention", "linear_attention", "full_attention"], "num_hidden_layers": 3}
    for name, model in (("qwen3_next", build_tiny("qwen3_next", **two)), ("zamba", _model("zamba"))):
        seqpar.parallelize(model, mesh)
        before = describe_token_mixers(model)
        set_mixer_mode(model, "state")
        vocab = decoder_config(model.config)[0].vocab_size
        _, mixer = token_mixers(model)[0]
        layer = {}
        for kind, seq, layout in (("plain", 64, "contiguous"), ("plain", 256, "contiguous"),
                                  ("packed", 64, "zigzag"), ("packed", 256, "zigzag")):
            local = seqpar.shard_batch(case_batch(ModelCase(batch=kind, seq=seq), vocab), mesh, layout=layout)
            x = torch.randn(2, local["input_ids"].shape[1], model.config.hidden_size, dtype=torch.float64,
                            requires_grad=True)
            with count_collectives() as fwd, count_collective_bytes() as fwd_bytes:
                y = mixer(x, seqpar_batch=local[BATCH_KWARG])
            with count_collectives() as bwd, count_collective_bytes() as bwd_bytes:
                y.sum().backward()
            layer[(kind, seq, layout)] = (dict(fwd), dict(bwd), sum(fwd_bytes.values()) + sum(bwd_bytes.values()))
        local = seqpar.shard_batch(case_batch(ModelCase(batch="padded", seq=11), vocab), mesh)
        with count_collectives() as whole_fwd:
            loss = model(**local).loss
        with count_collectives() as whole_bwd:
            loss.backward()
        out[name] = {"layer": layer, "whole": (dict(whole_fwd), dict(whole_bwd)), "before": before,
                     "after": describe_token_mixers(model), "mixers": len(token_mixers(model)),
                     "heads": getattr(mixer, "n_mamba_heads", 1),
                     "attention": sum(t in ("full_attention", "hybrid") for t in getattr(model.config, "layer_types",
                                                                                      None) or [])}
        seqpar.unparallelize(model)
    return out


def _choice(rank, world):
    """A Qwen3-Next left to choose: its first forward measures state passing and split by heads
    once (one all-reduce of the times), the second reuses the decision; no parameter gradient and
    no random state is touched by measuring."""
    import seqpar
    from seqpar.comm.counting import count_collectives
    from seqpar.integrations.mixers import choice, chosen_modes, describe_token_mixers
    from seqpar.integrations.models import decoder_config
    from seqpar.testing.model_parity import ModelCase, case_batch
    from seqpar.testing.zoo import build_tiny

    torch.set_num_threads(1)
    choice.CALIBRATION_TOKENS = 64  # the mechanics, not the speed: a shorter measurement (this process only)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    model = build_tiny("qwen3_next", layer_types=["linear_attention", "linear_attention", "full_attention"],
                       num_hidden_layers=3)
    seqpar.parallelize(model, mesh)
    local = seqpar.shard_batch(case_batch(ModelCase(batch="packed", seq=17), decoder_config(model.config)[0]
                                          .vocab_size), mesh)
    rng = torch.get_rng_state()
    with count_collectives() as first:
        model(**local)
    untouched = all(q.grad is None for q in model.parameters()) and torch.equal(rng, torch.get_rng_state())
    with count_collectives() as second:
        model(**local).loss.backward()
    out = {"first": dict(first), "second": dict(second), "untouched": untouched, "modes": chosen_modes(model),
           "said": describe_token_mixers(model)}
    seqpar.unparallelize(model)
    return out


def _default_run(rank, world):
    return {"choice": _choice(rank, world), "counts": _layer_counts(rank, world)}


@pytest.fixture(scope="module")
def default_run():
    """One spawn of 2 processes for ``make test``: the counts and the measured choice. Whole-model
    parity at P = 2 runs in the zoo (every hybrid family in state passing, float64 scans) and, with
    P = 1, 3, 4, in the heavy grid below; the kernels at P = 1..4 above."""
    from seqpar.comm.launch import run_distributed

    return run_distributed(_default_run, 2, timeout=900)


@pytest.mark.distributed
def test_collectives_and_bytes_per_state_passing_layer(default_run):
    for res in default_run:
        gdn, zamba = res["counts"]["qwen3_next"], res["counts"]["zamba"]
        for r, gathers in ((gdn, 2), (zamba, 1 + zamba["heads"])):  # the halo's tails, then (M, B) per scan call
            for fwd, bwd, _ in r["layer"].values():
                assert fwd == {"all_gather_flat": gathers} and bwd == {"reduce_scatter_flat": gathers}, r["layer"]
            sizes = {k: b for k, (_, _, b) in r["layer"].items()}
            # independent of S: 64 and 256 tokens move the same bytes (contiguous rows; packed zigzag rows)
            assert sizes[("plain", 64, "contiguous")] == sizes[("plain", 256, "contiguous")], sizes
            assert sizes[("packed", 64, "zigzag")] == sizes[("packed", 256, "zigzag")], sizes
        # whole Qwen3-Next (2 Gated DeltaNet layers, 1 attention): per attention layer Ulysses' 2
        # exchanges each way, the loss's all-reduce, the backward's failure check (test_hf); this is
        # the model's first forward, so also its one strategy agreement (test_hf); a MoE with the zoo's
        # router logits on: one more all-reduce each way, of the router statistics (batch/router_loss.py)
        m, a = gdn["mixers"], gdn["attention"]
        assert gdn["whole"] == ({"batch_isend_irecv": 2 * a, "all_reduce": 2, "all_gather_flat": 2 * m + 1},
                                {"batch_isend_irecv": 2 * a, "all_gather_flat": 1, "reduce_scatter_flat": 2 * m,
                                 "all_reduce": 1}), gdn
        assert "not run yet" in gdn["before"] and "state passing" in gdn["after"], gdn
        assert "set by set_mixer_mode" in gdn["after"], gdn


@pytest.mark.distributed
def test_mode_is_measured_once_and_said(default_run):
    choices = [r["choice"] for r in default_run]
    first, second = choices[0]["first"], choices[0]["second"]
    # the first forward: the loss's all-reduce, the router statistics' (Qwen3-Next is a MoE, its router
    # logits on in the zoo) and one of the measurement (one mixer class); the second step the first two
    # and the router statistics' backward
    assert first["all_reduce"] == 3 and second["all_reduce"] == 3, choices[0]
    assert all(c["untouched"] for c in choices), choices
    modes = {tuple(sorted(c["modes"].items())) for c in choices}  # the same decision on every rank
    assert len(modes) == 1 and set(choices[0]["modes"].values()) <= {"state", "heads"}, modes
    assert "measured state" in choices[0]["said"] and "heads" in choices[0]["said"], choices[0]["said"]


@pytest.mark.heavy
@pytest.mark.distributed
def test_state_passing_with_the_models_float32_scans():
    """As shipped, the scans compute in float32: the sharded model is as close to the float64
    truth as the unsharded one (within twice its largest relative error, which is float32's: > 1e-8)."""
    from seqpar.comm.launch import run_distributed

    for r in run_distributed(_as_shipped, 2, ["qwen3_next", "bamba/attention-layers"], QUICK, timeout=900)[0]:
        assert r["modes"] == {FAMILIES[r["family"]]: "state"}, r
        assert 1e-8 < r["own"] and r["sharded"] <= 2 * r["own"], r


@pytest.mark.heavy
@pytest.mark.distributed
def test_state_passing_float64_exact_p1_to_p4():
    """Every family issue 28 names, P = 1..4, uneven lengths, padded / packed / plain rows,
    contiguous, zigzag and doc-zigzag layouts, Ulysses and ring."""
    from seqpar.comm.launch import run_distributed

    rows = run_distributed(_strict_rows, 4, list(FAMILIES), (1, 2, 3, 4), HEAVY, timeout=3600)[0]
    _check_strict(rows, list(FAMILIES), (1, 2, 3, 4), HEAVY)


@pytest.mark.heavy
@pytest.mark.distributed
def test_state_passing_float64_exact_hybrid_strategy():
    from seqpar.comm.launch import run_distributed

    grid = [("packed", 17, "hybrid", "doc-zigzag"), ("padded", 15, "hybrid", "zigzag")]
    rows = run_distributed(_strict_rows, 4, list(FAMILIES), (4,), grid, timeout=1800)[0]
    _check_strict(rows, list(FAMILIES), (4,), grid)


# ---------------------------------------------------------------------------------------------
# the state-passing kernels on P ranks simulated in one process: forward and backward of each
# scan (float64 oracles) and of the halo convolution against the unsharded kernel per document
# ---------------------------------------------------------------------------------------------

class _InProcessGather:
    """The all-gather of P ranks that run as threads of this process: each rank's tensor in rank
    order, through ``torch.cat`` -- whose backward hands each rank the sum of every rank's gradient
    of its slice, as the real all-gather's reduce-scatter does."""

    def __init__(self, p):
        import threading

        self.slots, self.barrier = [None] * p, threading.Barrier(p, timeout=60)

    def rank(self, r):
        def gather(t, *, sizes):
            assert t.shape[0] == sizes[r], (t.shape, sizes, r)
            self.slots[r] = t
            self.barrier.wait()
            out = torch.cat(self.slots)
            self.barrier.wait()  # every rank has read the slots before the next gather fills them
            return out

        return gather


def _kernel_case(name, rows, s, seed=0):
    """``(family class, method, kernel, args, kwargs, out_dim)`` for one kernel: ``args`` /
    ``kwargs`` hold ``(value, token dim or None)``; every tensor is a float64 leaf."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift).requires_grad_()

    def neg(*shape):  # decays
        return (-torch.rand(*shape, generator=gen, dtype=torch.float64) - 0.1).requires_grad_()

    if name in ("gated_delta_rule", "kimi_delta_rule"):
        h, hk, k, v = 4, 2 if name == "gated_delta_rule" else 4, 3, 4
        g = neg(rows, s, h, *((k,) if name == "kimi_delta_rule" else ()))
        beta = torch.rand(rows, s, h, generator=gen, dtype=torch.float64).requires_grad_()
        cls = "Qwen3NextGatedDeltaNet" if name == "gated_delta_rule" else "KimiLinearDeltaAttention"
        return (cls, "scan", getattr(scans64, name), [(rnd(rows, s, hk, k), 1), (rnd(rows, s, hk, k), 1),
                                                      (rnd(rows, s, h, v), 1)],
                {"g": (g, 1), "beta": (beta, 1), "initial_state": (None, None), "output_final_state": (False, None),
                 "use_qk_l2norm_in_kernel": (True, None)}, 1)
    if name == "mamba2_scan":
        h, p, g, n = 4, 3, 2, 3
        return ("BambaMixer", "scan", scans64.mamba2_scan,
                [(rnd(rows, s, h, p), 1), (rnd(rows, s, h), 1), (neg(h), None), (rnd(rows, s, g, n), 1),
                 (rnd(rows, s, g, n), 1)],
                {"chunk_size": (8, None), "D": (rnd(h), None), "z": (None, None), "return_final_states": (False, None),
                 "dt_bias": (rnd(h), None), "dt_softplus": (True, None), "initial_states": (None, None),
                 "dt_limit": ((0.0, float("inf")), None)}, 1)
    if name == "selective_scan":
        i, n = 4, 3
        return ("JambaMambaMixer", "scan", scans64.selective_scan,
                [(rnd(rows, i, s), 2), (rnd(rows, i, s), 2), (neg(i, n), None), (rnd(rows, n, s), 2),
                 (rnd(rows, n, s), 2)],
                {"D": (rnd(i), None), "z": (rnd(rows, i, s), 2), "delta_bias": (rnd(i), None),
                 "delta_softplus": (True, None), "return_last_state": (False, None)}, 2)
    assert name == "conv"
    conv = _modeling("qwen3_next").causal_conv1d_fn  # the model's own: float64 when its inputs are
    return ("Qwen3NextGatedDeltaNet", "conv", conv, [(rnd(rows, 5, s), 2), (rnd(5, 4), None)],
            {"bias": (rnd(5), None), "activation": ("silu", None)}, 2)


def _documents(rows, s, segments, keep):
    """``(row, start, end)`` of every document in original order (unpacked: whole rows)."""
    if segments is None:
        return [(b, 0, s) for b in range(rows)]
    out = []
    for b in range(rows):
        a = 0
        for o in range(1, s + 1):
            if o == s or segments[b, o] != segments[b, a] or keep[b, o] != keep[b, a]:
                if keep[b, a]:
                    out.append((b, a, o))
                a = o
    return out


def _kernel_parity(name, p, layout, packed):
    """The largest difference of output and every input's gradient, P simulated ranks against
    the kernel run on each document alone; and the collectives each rank joined."""
    from concurrent.futures import ThreadPoolExecutor

    from seqpar.integrations.mixers.state_passing import StateCall

    rows, s = 2, 17
    segments = keep = None
    if packed:
        docs = [_docs([5, 7, 5]), _docs([8, 4], pad=5)]  # documents across ranks, padding at the end
        segments, keep = torch.stack([d[0] for d in docs]), torch.stack([d[1] for d in docs])
    cls, method, fn, args, kwargs, out_dim = _kernel_case(name, rows, s)
    leaves = [v for v, _ in [*args, *kwargs.values()] if isinstance(v, torch.Tensor)]

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def sliced(select):
        return ([select(v, d) if d is not None else v for v, d in args],
                {k: select(v, d) if d is not None else v for k, (v, d) in kwargs.items()})

    w = torch.randn(*first(fn(*sliced(lambda v, d: v.detach())[0], **sliced(lambda v, d: v.detach())[1])).shape,
                    generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref, ref_loss = torch.zeros_like(w), 0.0
    for b, a, e in _documents(rows, s, segments, keep):
        a_, k_ = sliced(lambda v, d, b=b, a=a, e=e: v[b:b + 1].narrow(d, a, e - a))
        out = first(fn(*a_, **k_))
        ref[b:b + 1].narrow(out_dim, a, e - a).copy_(out.detach())
        ref_loss = ref_loss + (out * w[b:b + 1].narrow(out_dim, a, e - a)).sum()
    ref_grads = torch.autograd.grad(ref_loss, leaves)

    shard = _shard(s, p, layout, segments, keep)
    order = torch.arange(s) if shard.positions is None else shard.positions
    offsets = [sum(shard.seq_lens[:r]) for r in range(p)]
    plan, gather = piece_plan(shard, rows), _InProcessGather(p)
    kernels = HANDLED_MIXERS[cls].state
    joined = [0] * p

    def run_rank(r):
        idx = order[offsets[r]:offsets[r] + shard.seq_lens[r]]  # original index of each local token

        to_all = gather.rank(r)

        def counted(t, *, sizes):
            joined[r] += 1
            return to_all(t, sizes=sizes)

        call = StateCall(kernels, plan, r, counted)
        call.originals = {kernels.scan: fn, kernels.conv: fn}
        a_, k_ = sliced(lambda v, d: v.index_select(d, idx))
        return idx, first(getattr(call, method)(*a_, **k_))

    with ThreadPoolExecutor(p) as pool:
        outs = list(pool.map(run_rank, range(p)))
    got = torch.zeros_like(w)
    loss = 0.0
    for idx, out in outs:
        got.index_copy_(out_dim, idx, out.detach())
        loss = loss + (out * w.index_select(out_dim, idx)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return (float((got - ref).abs().max()), max(float((g - rg).abs().max()) for g, rg in zip(grads, ref_grads,
                                                                                             strict=True)), joined)


KERNELS = ["gated_delta_rule", "kimi_delta_rule", "mamba2_scan", "selective_scan", "conv"]


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_state_passing_kernels_float64_exact(name, p):
    """Uneven shards (17 tokens), unpacked rows in the contiguous layout, packed rows (documents
    spanning ranks, padding) in doc-zigzag: output and every input's gradient (parameters summed
    over ranks) to float64 rounding; every rank joins one all-gather per call."""
    for layout, packed in (("contiguous", False), ("doc-zigzag", True)):
        out, grad, joined = _kernel_parity(name, p, layout, packed)
        assert out <= 1e-12 and grad <= 1e-12, (layout, packed, out, grad)
        assert joined == [1] * p, joined


@pytest.mark.heavy
@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("layout,packed", [("zigzag", False), ("contiguous", True), ("zigzag", True)])
def test_state_passing_kernels_float64_exact_layouts(name, p, layout, packed):
    out, grad, joined = _kernel_parity(name, p, layout, packed)
    assert out <= 1e-12 and grad <= 1e-12, (layout, packed, out, grad)
    assert joined == [1] * p, joined


# ---------------------------------------------------------------------------------------------
# an untested transformers: a kernel state passing needs is gone -> one warning at parallelize
# (rank 0), the mixer runs in its fallback; the feature report says the same
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def scan_missing(monkeypatch):
    """Qwen3-Next's modeling module without its chunked scan (as a release that renamed it)."""
    from seqpar.integrations.mixers import state_passing

    module = _modeling("qwen3_next")
    monkeypatch.delattr(module, "torch_chunk_gated_delta_rule")
    state_passing._route.cache_clear()
    yield module
    state_passing._route.cache_clear()


def _parallelize_warnings(rank, world):
    import warnings

    import seqpar
    from seqpar.compat import fake_process_group
    from seqpar.testing.zoo import build_tiny

    model = build_tiny("qwen3_next", layer_types=["linear_attention", "full_attention"], num_hidden_layers=2)
    with fake_process_group(rank, world), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seqpar.parallelize(model, seqpar.init_mesh(sp=world, device_type="cpu"))
        seqpar.unparallelize(model)
    from seqpar.errors import FeatureUnavailable

    return [str(w.message) for w in caught if issubclass(w.category, FeatureUnavailable)]


def test_missing_kernel_is_one_warning_on_rank_0(scan_missing):
    import transformers

    from seqpar.integrations.hf.features import feature_report

    said = _parallelize_warnings(0, 2)
    assert len(said) == 1, said
    msg = said[0]
    assert msg.startswith(f"state passing unavailable on transformers {transformers.__version__}: "
                          "Qwen3NextGatedDeltaNet runs split by heads"), msg
    assert "memory per rank does not divide by P" in msg and "torch_chunk_gated_delta_rule" in msg, msg
    assert _parallelize_warnings(1, 2) == []  # the other ranks stay quiet
    row = next(r for r in feature_report() if r.feature == "state passing: Qwen3NextGatedDeltaNet")
    assert not row.available and "torch_chunk_gated_delta_rule" in row.detail, row


def test_installed_transformers_gives_no_warning_and_a_full_report():
    from seqpar.integrations.hf.features import MIXER_MODELING, feature_report

    assert _parallelize_warnings(0, 2) == []
    rows = {r.feature: r for r in feature_report()}
    assert {f"state passing: {c}" for c in MIXER_MODELING} <= set(rows)
    features = [r for name, r in rows.items() if not name.startswith("versions: ")]
    assert all(r.available for r in features), [r for r in features if not r.available]
    for package, checked in CHECKED_ON.items():  # a version row says whether the installed one was checked
        installed = importlib.metadata.version(package).split("+")[0]
        assert rows[f"versions: {package}"].available == (installed in checked), rows[f"versions: {package}"]
    assert set(MIXER_MODELING) == {c for c, f in HANDLED_MIXERS.items() if STATE in f.modes}


def test_a_helper_kernelize_replaced_makes_state_passing_unfit(monkeypatch):
    """5.25 reaches the convolution through ``causal_conv1d_forward``: a kernel that ``kernelize``
    put there would bypass the swapped ``causal_conv1d_fn``, so state passing must not run."""
    from seqpar.compat import kernel_route
    from seqpar.integrations.mixers import state_passing
    from seqpar.testing.zoo import build_tiny

    model = build_tiny("qwen3_next", layer_types=["linear_attention", "full_attention"], num_hidden_layers=2)
    mixer = next(m for m in model.modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet")
    family = family_of(mixer)
    helpers = {v for v in kernel_route(type(mixer), family.state.names).values() if v is not None}
    assert state_passing.state_unavailable(family, mixer) is None
    monkeypatch.setattr(state_passing, "kernelized_funcs", lambda m: {"causal_conv1d_forward", "unrelated"})
    why = state_passing.state_unavailable(family, mixer)
    if "causal_conv1d_forward" in helpers:  # transformers >= 5.25
        assert why is not None and "kernelize replaced causal_conv1d_forward" in why, why
    else:  # 5.24: forward calls causal_conv1d_fn itself, no helper on the way
        assert why is None
