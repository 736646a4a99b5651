"""reduce_memory under sequence parallelism (issue 11), float64 on gloo: whole models with every
switch on (tiled loss, tiled MLP, per-layer checkpoints) against the non-SP reference (loss 1e-9,
every parameter gradient 1e-8) for Ulysses and ring, padded / packed / plain rows at odd lengths;
the tiled loss against seqpar's untiled one with loss_weights and num_items_in_batch (1e-10 /
1e-9); token_stats on shards; FSDP2; collectives counted with the checkpoints' recompute; tile
counts agreed over uneven shards; a head it cannot reproduce refused on every rank. One spawn of 2
processes. ``heavy``: the P = 1..4 x strategy grid, hybrid at P=4 included (one spawn of 4)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import seqpar
from seqpar.batch.tiled_loss import Head, tiled_gather_log_probs
from seqpar.comm.counting import count_collectives
from seqpar.comm.launch import run_distributed
from seqpar.integrations.memory.tiling import _TiledMLP, agreed_tiles
from seqpar.integrations.state import state_of
from seqpar.testing.model_parity import (
    GRAD_TOL,
    LOSS_TOL,
    ModelCase,
    case_batch,
    make_model,
    reference_grads,
    sp_meshes,
)

pytestmark = pytest.mark.distributed

SWITCHES = dict(tiled_loss=True, tiled_mlp=True, checkpoint="layers", loss_tile=3, mlp_tile=2)
DEFAULT = [(2, ModelCase(strategy="ulysses", batch="padded", seq=13)),
           (2, ModelCase(strategy="ring", batch="packed", seq=17, layout="zigzag")),
           (1, ModelCase(strategy="ulysses", batch="plain", seq=13))]
GRID = [(p, ModelCase(strategy=s, batch=b, seq=n, layout=lay))
        for p in (1, 2, 3, 4) for s in ("ulysses", "ring", "hybrid") if s != "hybrid" or p == 4
        for b, n, lay in (("padded", 16, "contiguous"), ("packed", 17, "zigzag"), ("plain", 13, "contiguous"))]


def _grad_diff(model, ref_grads):
    worst = 0.0
    for n, q in model.named_parameters():
        g = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
        worst = max(worst, float((g - ref_grads[n]).abs().max()))
    return worst


def _parity(cases, world):
    """Every case with every switch on against the float64 reference: (P, label, loss diff, grad diff)."""
    rows = []
    for p, case in cases:
        mesh = sp_meshes(world, (p,), case.strategy)[p]
        if mesh is None:
            continue
        model = make_model(case)
        batch = case_batch(case, model.config.vocab_size)
        ref_loss, ref_grads = reference_grads(model, batch, loss_scale=p)  # the scale seqpar's loss runs at
        sp = seqpar.reduce_memory(seqpar.parallelize(copy.deepcopy(model), mesh, strategy=case.strategy), mesh,
                                  **SWITCHES)
        loss = sp(**seqpar.shard_batch(batch, mesh, layout=case.layout)).loss
        loss.backward()
        seqpar.sync_gradients(sp, mesh)
        seqpar.unparallelize(sp)
        rows.append((p, case.label(), abs(float(loss.detach()) - ref_loss), _grad_diff(sp, ref_grads)))
    return rows


def _tiled_vs_untiled(world):
    """seqpar's untiled loss and the tiled one on the same sharded batch with loss_weights and
    num_items_in_batch (sp=2; with 4 processes dp=2 x sp=2, each dp rank its own batch): (loss diff,
    grad diff)."""
    mesh = seqpar.init_mesh(sp=2, **({"dp": world // 2} if world > 2 else {}), device_type="cpu")
    dp = mesh.get_local_rank("dp") if world > 2 else 0
    model = make_model(ModelCase())
    out = []
    for kind, seq in (("padded", 13), ("packed", 15)):
        batch = case_batch(ModelCase(batch=kind, seq=seq, seed=dp), model.config.vocab_size)
        batch["loss_weights"] = torch.rand(batch["labels"].shape, generator=torch.Generator().manual_seed(dp),
                                           dtype=torch.float64)
        results = []
        for tiled in (False, True):
            m = seqpar.parallelize(copy.deepcopy(model), mesh)
            if tiled:
                seqpar.reduce_memory(m, mesh, **SWITCHES)
            for n_items in (None, 29.0):
                m.zero_grad(set_to_none=True)
                loss = m(**seqpar.shard_batch(batch, mesh, num_items_in_batch=n_items)).loss
                loss.backward()
                results.append((float(loss.detach()), {n: q.grad.clone() for n, q in m.named_parameters()}))
        for (la, ga), (lb, gb) in zip(results[:2], results[2:], strict=True):
            out.append((abs(la - lb), max(float((ga[n] - gb[n]).abs().max()) for n in ga)))
    return out


def _eval(world):
    """token_stats on a sharded batch, summed over the SP ranks, against the full model's logits:
    (loss sum diff, correct count, reference correct count, target count, reference target count)."""
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    case = ModelCase(batch="padded", seq=15)
    model = make_model(case)
    batch = case_batch(case, model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    valid = targets != -100
    ref_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    ref_correct = int(((logits.argmax(-1) == targets) & valid).sum())
    sp = seqpar.reduce_memory(seqpar.parallelize(copy.deepcopy(model), mesh), mesh, loss_tile=4)
    stats = seqpar.token_stats(sp, seqpar.shard_batch(batch, mesh))
    totals = torch.stack([stats.losses.sum(), stats.correct.sum().double(), stats.valid.sum().double()])
    dist.all_reduce(totals, group=mesh.get_group("sp"))
    return (abs(float(totals[0] - ref_sum)), int(totals[1]), ref_correct, int(totals[2]), int(valid.sum()))


def _log_probs(world):
    """tiled_gather_log_probs against gather_log_probs on the full local logits, on a zigzag shard:
    (value diff, hidden grad diff, weight grad diff)."""
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    case = ModelCase(batch="packed", seq=15)
    model = make_model(case)
    local = seqpar.shard_batch(case_batch(case, model.config.vocab_size), mesh, layout="zigzag")
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(*local["labels"].shape, 32, generator=g, dtype=torch.float64, requires_grad=True)
    weight = model.lm_head.weight.detach().clone().requires_grad_(True)
    mine = tiled_gather_log_probs(hidden, Head(weight), local, mesh, tile=4)  # [B, S]
    ref = seqpar.gather_log_probs(F.linear(hidden, weight), local, mesh)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)  # the same sequence-level loss on every rank
    ga = torch.autograd.grad((mine * w).sum(), (hidden, weight))
    gb = torch.autograd.grad((ref * w).sum(), (hidden, weight))
    return (float((mine - ref).abs().max()), *(float((a - b).abs().max()) for a, b in zip(ga, gb, strict=True)))


def _fsdp(world):
    """FSDP2 over the sp ranks (lm_head sharded) with every switch on, against the reference."""
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    case = ModelCase(batch="packed", seq=13)
    model = make_model(case)
    batch = case_batch(case, model.config.vocab_size)
    ref_loss, ref_grads = reference_grads(model, batch)
    sp = seqpar.reduce_memory(seqpar.parallelize(copy.deepcopy(model), mesh), mesh, **SWITCHES)
    seqpar.apply_fsdp(sp, mesh)
    loss = sp(**seqpar.shard_batch(batch, mesh)).loss
    loss.backward()
    return abs(float(loss.detach()) - ref_loss), _grad_diff(sp, ref_grads)


def _small_model(world, case):
    """(mesh over every rank, the case's float64 model, its full batch)."""
    model = make_model(case)
    return seqpar.init_mesh(sp=world, device_type="cpu"), model, case_batch(case, model.config.vocab_size)


def _switched(model, mesh, strategy, checkpoint):
    """A parallelized copy of ``model`` with small tiles and ``checkpoint``."""
    m = seqpar.parallelize(copy.deepcopy(model), mesh, strategy=strategy)
    return seqpar.reduce_memory(m, mesh, checkpoint=checkpoint, loss_tile=4, mlp_tile=3)


def _counts(world):
    """Collectives of a forward and a backward, checkpoint="layers" vs "none" (after a first step,
    whose one-time head check adds an all-gather): per strategy, (fwd none, bwd none, fwd ckpt, bwd ckpt)."""
    mesh, model, batch = _small_model(world, ModelCase(batch="padded", seq=15))
    out = {}
    for strategy in ("ulysses", "ring"):
        for ckpt in ("none", "layers"):
            m = _switched(model, mesh, strategy, ckpt)
            local = seqpar.shard_batch(batch, mesh)
            m(**local).loss.backward()
            with count_collectives() as fwd:
                loss = m(**local).loss
            with count_collectives() as bwd:
                loss.backward()
            out[(strategy, ckpt)] = (dict(fwd), dict(bwd))
    return out


def _steady_tensors(world):
    """Live 4-d tensors (attention's q, k, v, out) after steps 2 and 4 of a checkpointed model, per
    strategy: a step must leave nothing behind (a C++ reference cycle in a kept inner graph leaked
    q, k, v, out every step)."""
    import gc

    mesh, model, batch = _small_model(world, ModelCase(batch="plain", seq=16))
    out = {}
    for strategy in ("ulysses", "ring"):
        m = _switched(model, mesh, strategy, "layers")
        alive = []
        for step in range(4):
            m(**seqpar.shard_batch(batch, mesh)).loss.backward()
            m.zero_grad(set_to_none=True)
            if step in (1, 3):
                gc.collect()
                alive.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dim() == 4))
        out[strategy] = alive
    return out


class _Chatty(nn.Module):
    """A per-token module that holds a collective (as an FSDP-sharded one would): one all-reduce per call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        flag = torch.ones(1, dtype=torch.float64)
        dist.all_reduce(flag)
        return self.lin(x) * flag / dist.get_world_size()


def _uneven(rank, world):
    """Uneven shards (S=9 over 2 ranks: 5 and 4 tokens), tile 4: the tile counts of every MLP call
    agree across ranks; a module with a collective inside runs tiled forward + backward without
    hanging and matches its untiled result."""
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    case = ModelCase(batch="plain", seq=9)
    model = make_model(case)
    sp = seqpar.reduce_memory(seqpar.parallelize(copy.deepcopy(model), mesh), mesh, tiled_mlp=True, mlp_tile=4)
    local = seqpar.shard_batch(case_batch(case, model.config.vocab_size), mesh)
    sp(**local).loss.backward()
    tiles = list(state_of(sp).memory.context.tiles_run)
    mine = local["input_ids"].shape[1]
    chatty = _Chatty()
    x = torch.randn(1, mine, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    n = agreed_tiles(mine, 5, 4)
    with count_collectives() as calls:
        y = _TiledMLP.apply(chatty, n, 4, x, *chatty.parameters())
        y.sum().backward()
    gx, gw = x.grad.clone(), chatty.lin.weight.grad.clone()
    x.grad = chatty.lin.weight.grad = None
    chatty(x).sum().backward()
    diff = max(float((gx - x.grad).abs().max()), float((gw - chatty.lin.weight.grad).abs().max()))
    return {"local": mine, "tiles": tiles, "n": n, "all_reduce": calls["all_reduce"], "diff": diff}


def _scaled_output(_module, _args, out):
    return out * 2.0


def _refusal(world):
    """Bad options and a head whose logits seqpar cannot reproduce: {what: the ValueError's text}, the
    same on every rank (None: nothing raised)."""
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    model = make_model(ModelCase())
    seqpar.parallelize(model, mesh)
    out = {}
    for what, kwargs in (("tile 0", {"loss_tile": 0}), ("no mesh", {}), ("unknown checkpoint", {"checkpoint": "x"})):
        try:
            seqpar.reduce_memory(model, None if what == "no mesh" else mesh, **kwargs)
            out[what] = None
        except ValueError as e:
            out[what] = str(e)
    model.lm_head.register_forward_hook(_scaled_output)
    seqpar.reduce_memory(model, mesh)
    try:
        model(**seqpar.shard_batch(case_batch(ModelCase(batch="plain", seq=12), model.config.vocab_size), mesh))
        out["head"] = None
    except ValueError as e:
        out["head"] = str(e)
    return out


def _seqpar_attributes(model):
    """``{module name: the _seqpar* attributes seqpar left on it}``, modules without any left out."""
    out = {}
    for name, m in model.named_modules():
        attrs = sorted(a for a in vars(m) if a.startswith("_seqpar"))
        if attrs:
            out[name] = attrs
    return out


def _fingerprint(model):
    """What parallelize / reduce_memory change on a model, to compare before and after an undo."""
    loss = model.loss_function
    return {"attention": model.config._attn_implementation, "loss": getattr(loss, "__qualname__", type(loss).__name__),
            "pre_hooks": len(model._forward_pre_hooks), "hooks": sum(len(m._forward_hooks) for m in model.modules()),
            "forwards": sorted(n for n, m in model.named_modules() if "forward" in vars(m)),
            "attributes": _seqpar_attributes(model)}


def _undo_stack(world):
    """The one state record and its undo stack: where seqpar keeps its state, what restore_memory and
    unparallelize pop, a deep copy undone on its own, and a parallelize that fails half-way rolled back."""
    import seqpar.integrations.hf.parallelize as hf

    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    model = make_model(ModelCase())
    plain, plain_loss = _fingerprint(model), model.loss_function
    seqpar.parallelize(model, mesh)
    parallel, parallel_loss = _fingerprint(model), model.loss_function
    steps_parallel = state_of(model).pending()
    seqpar.reduce_memory(model, mesh, **SWITCHES)
    out = {"plain": plain, "parallel": parallel, "steps_parallel": steps_parallel,
           "attributes": _seqpar_attributes(model), "steps": state_of(model).pending(),
           "memory_steps": state_of(model).pending("memory"), "switched": _fingerprint(model)}
    twin = copy.deepcopy(model)  # an EMA / DPO reference copy: undone on its own, the original untouched
    seqpar.unparallelize(twin)
    out["twin"], out["original after twin"] = _fingerprint(twin), _fingerprint(model)
    out["twin record"] = state_of(twin) is None
    seqpar.restore_memory(model)
    out["restored"], out["steps_restored"] = _fingerprint(model), state_of(model).pending()
    out["same losses"] = [model.loss_function is parallel_loss]
    out["memory_switches"] = seqpar.memory_switches(model)
    seqpar.reduce_memory(model, mesh, **SWITCHES)
    seqpar.unparallelize(model)
    out["unparallelized"], out["record"] = _fingerprint(model), state_of(model) is None
    out["same losses"].append(model.loss_function is plain_loss)

    def broken(*_args, **_kwargs):
        raise RuntimeError("token mixers failed")

    wrap, hf.wrap_token_mixers = hf.wrap_token_mixers, broken
    try:
        seqpar.parallelize(model, mesh)
    except RuntimeError as e:
        out["failed"] = str(e)
    finally:
        hf.wrap_token_mixers = wrap
    out["rolled back"], out["record after failure"] = _fingerprint(model), state_of(model) is None
    return out


def run_default(rank, world):
    torch.set_num_threads(1)
    return {"parity": _parity(DEFAULT, world), "tiled": _tiled_vs_untiled(world), "eval": _eval(world),
            "log_probs": _log_probs(world),
            "fsdp": _fsdp(world),
            "counts": _counts(world), "steady": _steady_tensors(world), "uneven": _uneven(rank, world),
            "refusal": _refusal(world), "undo": _undo_stack(world)}


def run_grid(rank, world):
    torch.set_num_threads(1)
    return {"parity": _parity(GRID, world), "tiled": _tiled_vs_untiled(world)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(run_default, 2, timeout=600)


def _assert_exact(rows):
    assert rows
    for p, label, loss_diff, grad_diff in rows:
        assert loss_diff <= LOSS_TOL and grad_diff <= GRAD_TOL, (p, label, loss_diff, grad_diff)


def test_every_switch_on_is_exact(results):
    _assert_exact([row for r in results for row in r["parity"]])
    assert {row[1].split()[3].split("/")[0] for row in results[0]["parity"]} == {"ulysses", "ring"}


def test_tiled_loss_equals_seqpars_untiled_loss_with_weights_and_num_items(results):
    rows = [row for r in results for row in r["tiled"]]
    assert len(rows) == 2 * 4
    assert all(loss <= 1e-10 and grad <= 1e-9 for loss, grad in rows), rows


def test_token_stats_on_shards_sum_to_the_full_models(results):
    for loss_diff, correct, ref_correct, count, ref_count in (r["eval"] for r in results):
        assert loss_diff <= LOSS_TOL and correct == ref_correct and count == ref_count > 0


def test_tiled_gather_log_probs_equals_gather_log_probs(results):
    for value, grad_hidden, grad_weight in (r["log_probs"] for r in results):
        assert value <= LOSS_TOL and grad_hidden <= GRAD_TOL and grad_weight <= GRAD_TOL


def test_fsdp2_with_every_switch(results):
    for loss_diff, grad_diff in (r["fsdp"] for r in results):
        assert loss_diff <= LOSS_TOL and grad_diff <= GRAD_TOL


def test_checkpoint_recompute_repeats_the_layer_collectives(results):
    counts = results[0]["counts"]
    for strategy in ("ulysses", "ring"):
        fwd_none, bwd_none = counts[(strategy, "none")]
        fwd_ckpt, bwd_ckpt = counts[(strategy, "layers")]
        assert fwd_ckpt == fwd_none  # checkpoints change nothing in the forward
        layers = dict(fwd_none)
        layers["all_reduce"] -= 1  # the loss's one all-reduce is outside the layers
        layers = {k: v for k, v in layers.items() if v}
        assert layers, fwd_none  # the layers do communicate
        recomputed = {k: bwd_ckpt.get(k, 0) - bwd_none.get(k, 0) for k in set(bwd_ckpt) | set(bwd_none)}
        recomputed = {k: v for k, v in recomputed.items() if v}
        # each layer's forward collectives once more: one recompute per layer (the attention kernel's
        # inner backward, a nested graph task, must not trigger a second one)
        assert recomputed == layers, (strategy, counts)
    assert all(r["counts"] == counts for r in results)  # every rank made the same calls


def test_checkpointed_steps_leave_no_tensors_behind(results):
    for res in results:
        for strategy, (after_2, after_4) in res["steady"].items():
            assert after_4 == after_2, (strategy, after_2, after_4)


def test_uneven_shards_agree_on_tile_counts(results):
    rows = [r["uneven"] for r in results]
    assert sorted({r["local"] for r in rows}) == [4, 5]  # uneven: 4 tokens on some ranks, 5 on others
    assert all(r["tiles"] and set(r["tiles"]) == {2} for r in rows)  # ceil(5 / 4) everywhere, not 1 on 4 tokens
    assert all(r["n"] == 2 and r["all_reduce"] == 4 for r in rows)  # 2 tiles forward + 2 recomputed, every rank
    assert all(r["diff"] <= 1e-12 for r in rows)


def test_bad_input_and_unknown_head_refused_on_every_rank(results):
    expected = {"tile 0": "loss_tile=0", "no mesh": "pass reduce_memory the mesh",
                "unknown checkpoint": "checkpoint='x'", "head": "tiled_loss=False"}
    for what, words in expected.items():
        messages = [r["refusal"][what] for r in results]
        assert messages[0] is not None and words in messages[0], (what, messages[0])
        assert all(m == messages[0] for m in messages), what


def test_one_state_record_on_the_model_nothing_on_its_modules(results):
    for r in (res["undo"] for res in results):
        # the model carries seqpar's one record; no submodule carries anything
        assert r["attributes"] == {"": ["_seqpar"]}, r["attributes"]
        assert r["plain"]["attributes"] == {}
        switched = r["switched"]["forwards"]
        assert len(switched) == 4 and all(n.endswith(("mlp", "layers.0", "layers.1")) for n in switched), switched


def test_undo_stack_restore_memory_pops_its_own_steps_unparallelize_all(results):
    for r in (res["undo"] for res in results):
        assert r["steps"][:len(r["steps_parallel"])] == r["steps_parallel"]  # parallelize's first, then memory's
        assert r["memory_steps"] and all(s.startswith("memory: ") for s in r["memory_steps"])
        assert r["steps"] == r["steps_parallel"] + r["memory_steps"]
        # restore_memory: back to the parallelized model, parallelize's steps still on the stack
        assert r["restored"] == r["parallel"] and r["steps_restored"] == r["steps_parallel"]
        assert r["memory_switches"] == {"tiled_loss": False, "tiled_mlp": False, "checkpoint": "none"}
        # unparallelize after reduce_memory again: the plain model, no record left
        assert r["unparallelized"] == r["plain"] and r["record"]
        assert r["same losses"] == [True, True]  # each loss function back as the very object it was
        assert r["plain"]["loss"] != r["parallel"]["loss"] != r["switched"]["loss"]  # the sensor sees them


def test_a_deep_copy_is_undone_on_its_own(results):
    for r in (res["undo"] for res in results):
        assert r["twin"] == r["plain"] and r["twin record"]  # the copy: plain again
        assert r["original after twin"] == r["switched"]  # the original: untouched


def test_a_parallelize_failing_half_way_is_rolled_back(results):
    for r in (res["undo"] for res in results):
        assert r["failed"] == "token mixers failed"
        assert r["rolled back"] == r["plain"] and r["record after failure"]


@pytest.mark.heavy
def test_grid_every_strategy_and_size():
    results = run_distributed(run_grid, 4, timeout=1500)
    rows = [row for r in results for row in r["parity"]]
    _assert_exact(rows)
    assert {p for p, *_ in rows} == {1, 2, 3, 4}
    assert {label.split()[3].split("/")[0] for _, label, *_ in rows} == {"ulysses", "ring", "hybrid"}
    tiled = [row for r in results for row in r["tiled"]]  # dp=2 x sp=2
    assert len(tiled) == 4 * 4 and all(loss <= 1e-10 and grad <= 1e-9 for loss, grad in tiled), tiled
