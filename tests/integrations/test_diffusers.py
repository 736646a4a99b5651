"""seqpar.parallelize on diffusers transformers (seqpar.integrations.diffusers), gloo, float64.

Issue 47's done-when cases (Flux, SD3, Wan at P = 2 and 3, Ulysses and ring, drop-in and sharded,
uneven token and head counts) run in the diffusers zoo (test_diffusers_zoo.py); here: bad input
raises the same error on every rank and never hangs, a wrong declaration is caught by the zoo's
comparison (so its "exact" means something), gradient checkpointing (diffusers' own and seqpar's
memory switches) stays exact -- also with two forwards before their backwards --, unparallelize
restores the model, and the rectified-flow pieces (loss on shards, timesteps, Euler sampler).
"""

from __future__ import annotations

import copy

import pytest
import torch

from seqpar.comm.launch import run_distributed

pytestmark = pytest.mark.distributed

EXACT = dict(loss=1e-9, grad=1e-8)


def _caught(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # the type and message every rank saw
        return type(e).__name__, str(e)
    return "none", ""


def _bad_inputs(rank, world):
    import seqpar
    from seqpar.testing.diffusers_specs import make_inputs
    from seqpar.testing.diffusers_zoo import build_dit

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    out = {"refused class": _caught(lambda: seqpar.parallelize(build_dit("SanaTransformer2DModel"), mesh))}

    from diffusers import ModelMixin

    class MyDiT(ModelMixin):
        def forward(self, x):
            return x

    out["unknown class"] = _caught(lambda: seqpar.parallelize(MyDiT(), mesh))
    out["bad output"] = _caught(lambda: seqpar.parallelize(build_dit("WanTransformer3DModel"), mesh, output="tokens"))
    model = seqpar.parallelize(build_dit("WanTransformer3DModel"), mesh)
    out["twice"] = _caught(lambda: seqpar.parallelize(model, mesh))
    inputs = make_inputs("WanTransformer3DModel")
    other = dict(inputs, hidden_states=inputs["hidden_states"] + (rank == 1))  # rank 1's latents differ
    out["values differ"] = _caught(lambda: model(**other))
    shorter = dict(inputs, hidden_states=inputs["hidden_states"][:, :, :, :, :8] if rank == 1 else
                   inputs["hidden_states"])  # rank 1's video is narrower: collectives would pair wrong sizes
    out["shapes differ"] = _caught(lambda: model(**shorter))
    out["after them"] = _caught(lambda: model(**inputs))  # the model still runs
    flux = seqpar.parallelize(build_dit("FluxTransformer2DModel"), mesh)
    residual = [torch.zeros(2, 13, 24, dtype=torch.float64)]
    flux_inputs = make_inputs("FluxTransformer2DModel")
    out["controlnet"] = _caught(lambda: flux(**flux_inputs, controlnet_block_samples=residual))
    from seqpar.testing.model_parity import ModelCase, make_model

    out["output on an LM"] = _caught(lambda: seqpar.parallelize(make_model(ModelCase()), mesh, output="sharded"))
    return out


def test_bad_input_raises_the_same_error_on_every_rank():
    per_rank = run_distributed(_bad_inputs, 2, timeout=300)
    assert per_rank[0].keys() == per_rank[1].keys()
    for case in per_rank[0]:
        kinds = {r[case][0] for r in per_rank}
        assert len(kinds) == 1, (case, [r[case] for r in per_rank])  # the same verdict on every rank
    rank0 = per_rank[0]
    assert rank0["refused class"][0] == "Refused" and "SanaTransformer2DModel" in rank0["refused class"][1]
    assert "GLUMBConv" in rank0["refused class"][1]
    assert rank0["unknown class"][0] == "Refused" and "MyDiT" in rank0["unknown class"][1]
    assert rank0["bad output"][0] == "ValueError" and "output='tokens'" in rank0["bad output"][1]
    assert rank0["twice"][0] == "ValueError" and "already parallelized" in rank0["twice"][1]
    assert rank0["values differ"][0] == "ValueError" and "rank 1's input values differ" in rank0["values differ"][1]
    assert rank0["shapes differ"][0] == "ValueError" and "other arguments" in rank0["shapes differ"][1]
    assert rank0["after them"] == ("none", "")
    assert rank0["controlnet"][0] == "Refused" and "controlnet_block_samples" in rank0["controlnet"][1]
    assert rank0["output on an LM"][0] == "ValueError" and "diffusers models" in rank0["output on an LM"][1]


def _wrong_declaration(rank, world):
    """Flux with its double-stream blocks' joint attention declared cross-attention (left local, each
    rank attending over its own tokens only): the zoo's comparison must call it a mismatch -- its
    "exact" is not vacuous."""
    import seqpar
    from seqpar.integrations.diffusers import families
    from seqpar.testing.diffusers_specs import make_inputs
    from seqpar.testing.diffusers_zoo import build_dit, compare_dit, reference

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    model, inputs = build_dit("FluxTransformer2DModel"), make_inputs("FluxTransformer2DModel")
    ref = reference(model, inputs)
    right = compare_dit(copy.deepcopy(model), inputs, mesh, strategy="ulysses", output="whole", ref=ref)
    real = families.FAMILIES["FluxTransformer2DModel"]
    families.FAMILIES["FluxTransformer2DModel"] = families.Family(
        attention={"transformer_blocks.*.attn": families.CROSS, "single_transformer_blocks.*.attn": families.JOINT},
        refuse_inputs=real.refuse_inputs)
    try:
        wrong = compare_dit(copy.deepcopy(model), inputs, mesh, strategy="ulysses", output="whole", ref=ref)
    finally:
        families.FAMILIES["FluxTransformer2DModel"] = real
    return right, wrong


def test_a_wrong_declaration_is_caught():
    for (loss, grad, _), (bad_loss, bad_grad, _) in run_distributed(_wrong_declaration, 2, timeout=300):
        assert loss <= EXACT["loss"] and grad <= EXACT["grad"]
        assert bad_loss > 1e-6 and bad_grad > 1e-6  # a mismatch, far outside the tolerances


def _checkpointed(rank, world):
    """Flux under diffusers' gradient checkpointing and under seqpar.reduce_memory (checkpointed
    blocks, tiled FeedForward), exact; and two forwards of different sizes before their two backwards.
    With the model's own float32 casts (a recompute runs outside the zoo's float64 mode), at P=2 where
    scaling a rank's share by 2 is exact in float32 too; Flux, whose float32 steps (RoPE) are per
    element (Wan's float32 modulation sums its parameters' gradients over tokens in float32, which a
    sharded run regroups)."""
    import seqpar
    from seqpar.integrations.diffusers import flow_matching_loss
    from seqpar.testing.diffusers_specs import make_inputs
    from seqpar.testing.diffusers_zoo import build_dit, compare_dit, reference

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    model, inputs = build_dit("FluxTransformer2DModel"), make_inputs("FluxTransformer2DModel")
    ref = reference(model, inputs, float64=False)
    out = {}
    theirs = copy.deepcopy(model)
    theirs.enable_gradient_checkpointing()
    out["diffusers checkpointing"] = compare_dit(theirs, inputs, mesh, strategy="ulysses", output="sharded", ref=ref,
                                                 float64=False)
    ours = seqpar.parallelize(copy.deepcopy(model), mesh)
    seqpar.reduce_memory(ours, mesh, checkpoint="layers", mlp_tile=3)
    switches = seqpar.memory_switches(ours)
    out["switches"] = {k: switches[k] for k in ("tiled_mlp", "checkpoint", "tiled_loss")}
    seqpar.unparallelize(ours)  # compare_dit parallelizes again (undoing reduce_memory too): re-apply after
    seqpar.parallelize(ours, mesh)
    seqpar.reduce_memory(ours, mesh, checkpoint="layers", mlp_tile=3)
    torch.manual_seed(7)
    loss = flow_matching_loss(ours(**inputs).sample, _target(ref[2]))
    loss.backward()
    seqpar.sync_gradients(ours, mesh)
    out["reduce_memory"] = _diff(ours, loss, ref)
    # two forwards (different video lengths), then their backwards in reverse order, checkpointed
    short = dict(inputs, hidden_states=inputs["hidden_states"][:, :9], img_ids=inputs["img_ids"][:9])
    ref_short = reference(model, short, float64=False)
    both = seqpar.parallelize(copy.deepcopy(model), mesh)
    both.enable_gradient_checkpointing()
    torch.manual_seed(7)
    first = flow_matching_loss(both(**inputs).sample, _target(ref[2]))
    torch.manual_seed(7)
    second = flow_matching_loss(both(**short).sample, _target(ref_short[2]))
    second.backward()
    first.backward()
    seqpar.sync_gradients(both, mesh)
    summed = (ref[0] + ref_short[0], {n: _add(ref[1][n], ref_short[1][n]) for n in ref[1]}, None)
    out["interleaved"] = _diff(both, first + second, summed)
    return out


def _add(a, b):
    return a if b is None else b if a is None else a + b


def _target(like):
    g = torch.Generator().manual_seed(1234)
    return torch.randn(like.shape, generator=g, dtype=like.dtype)


def _diff(model, loss, ref) -> tuple[float, float]:
    worst = max(float(((p.grad if p.grad is not None else 0) - (ref[1][n] if ref[1][n] is not None else 0)).abs().max())
                for n, p in model.named_parameters())
    return abs(float(loss.detach()) - ref[0]), worst


def test_checkpointing_and_memory_switches_stay_exact():
    for out in run_distributed(_checkpointed, 2, timeout=600):
        assert out["switches"] == {"tiled_mlp": True, "checkpoint": "layers", "tiled_loss": False}, out
        for case in ("diffusers checkpointing", "reduce_memory", "interleaved"):
            loss, grad = out[case][:2]
            assert loss <= EXACT["loss"] and grad <= EXACT["grad"], (case, out[case])


def _restored(rank, world):
    import seqpar
    from seqpar.testing.diffusers_specs import make_inputs
    from seqpar.testing.diffusers_zoo import build_dit

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    model, inputs = build_dit("FluxTransformer2DModel"), make_inputs("FluxTransformer2DModel")
    with torch.no_grad():
        before = model(**inputs).sample
        seqpar.parallelize(model, mesh, output="sharded")
        sharded = model(**inputs).sample
        seqpar.unparallelize(model)
        after = model(**inputs).sample
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    routed = sum("forward" in m.__dict__ for m in model.modules())
    return torch.equal(before, after), tuple(sharded.shape), hooks, routed, "_seqpar" in model.__dict__


def test_unparallelize_restores_the_model():
    for rank, (same, shape, hooks, routed, record) in enumerate(run_distributed(_restored, 2, timeout=300)):
        assert same and hooks == 0 and routed == 0 and not record
        assert shape == (2, (7, 6)[rank], 4)  # sharded: this rank's tokens of the 13 image tokens


def _flow(rank, world):
    import seqpar
    from seqpar.integrations.diffusers import flow_matching_loss

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(3, 11, 5, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randn(3, 11, 5, generator=g, dtype=torch.float64)
    weights = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    whole = flow_matching_loss(pred, target, weights=weights)
    whole.backward()
    sizes = (6, 5)[rank], (0, 6)[rank]
    mine = pred.detach()[:, sizes[1]:sizes[1] + sizes[0]].clone().requires_grad_(True)
    sharded = flow_matching_loss(mine, target[:, sizes[1]:sizes[1] + sizes[0]], weights=weights, mesh=mesh)
    sharded.backward()
    # seqpar's rule: each rank's gradient is its share times P, for the average over the ranks
    share = pred.grad[:, sizes[1]:sizes[1] + sizes[0]] * world
    return float(whole - sharded), float((mine.grad - share).abs().max())


def test_flow_matching_loss_on_shards_is_the_whole_mean():
    for loss_diff, grad_diff in run_distributed(_flow, 2, timeout=120):
        assert abs(loss_diff) <= 1e-15 and grad_diff <= 1e-15


def test_timesteps_noising_and_euler_sampling():
    from seqpar.integrations.diffusers import euler_sample, logit_normal_timesteps, noisy_latents, velocity_target

    g = torch.Generator().manual_seed(3)
    t = logit_normal_timesteps(1000, generator=g, dtype=torch.float64)
    assert t.shape == (1000,) and bool(((t > 0) & (t < 1)).all()) and abs(float(t.median()) - 0.5) < 0.05
    again = logit_normal_timesteps(1000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.equal(t, again)  # seeded alike on every rank: the same timesteps
    x0, noise = torch.randn(4, 3, 5, dtype=torch.float64), torch.randn(4, 3, 5, dtype=torch.float64)
    tt = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    xt = noisy_latents(x0, noise, tt)
    assert torch.equal(xt[0], x0[0]) and torch.equal(xt[3], noise[3])
    assert torch.allclose(xt[2], (x0[2] + noise[2]) / 2, atol=1e-15, rtol=0)
    v = velocity_target(x0, noise)
    # the exact velocity field of these straight lines: Euler integrates it exactly, from noise to data
    for steps, shift in ((1, 1.0), (7, 3.0)):
        out = euler_sample(lambda x, t: v, noise, steps=steps, shift=shift)
        assert torch.allclose(out, x0, atol=1e-14, rtol=0), (steps, shift)
    with pytest.raises(ValueError, match="steps=0"):
        euler_sample(lambda x, t: v, noise, steps=0)
    with pytest.raises(ValueError, match="same shape"):
        noisy_latents(x0, noise[:, :2], tt)


def _hybrid(rank, world):
    import seqpar
    from seqpar.testing.diffusers_specs import make_inputs
    from seqpar.testing.diffusers_zoo import build_dit, compare_dit, reference

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, ulysses=2, ring=world // 2, device_type="cpu")
    out = {}
    for name in ("FluxTransformer2DModel", "WanTransformer3DModel"):
        model, inputs = build_dit(name), make_inputs(name)
        ref = reference(model, inputs)
        for output in ("whole", "sharded"):
            out[(name, output)] = compare_dit(copy.deepcopy(model), inputs, mesh, strategy="hybrid", output=output,
                                              ref=ref)[:2]
    return out


@pytest.mark.heavy
def test_hybrid_ulysses_by_ring_is_exact():
    """Ulysses 2 x ring 2 over 4 ranks (Flux's joint attention, Wan's self-attention; 13 + 5 and 15
    tokens, 3 heads: nothing divides evenly)."""
    for out in run_distributed(_hybrid, 4, timeout=900):
        for case, (loss, grad) in out.items():
            assert loss <= EXACT["loss"] and grad <= EXACT["grad"], (case, loss, grad)


def _per_token_timesteps(rank, world):
    import seqpar
    from seqpar.testing.diffusers_specs import make_inputs
    from seqpar.testing.diffusers_zoo import build_dit, compare_dit, reference

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    out = {}
    for name, tokens, strategy, output in (("WanTransformer3DModel", 15, "ulysses", "sharded"),
                                           ("WanTransformer3DModel", 15, "ring", "whole"),
                                           ("LTXVideoTransformer3DModel", 30, "ulysses", "whole")):
        model, inputs = build_dit(name), make_inputs(name)
        inputs = dict(inputs, timestep=torch.linspace(100, 900, 2 * tokens, dtype=torch.float64).view(2, tokens))
        out[(name, strategy)] = compare_dit(copy.deepcopy(model), inputs, mesh, strategy=strategy, output=output,
                                            ref=reference(model, inputs))[:2]
    return out


def test_per_token_timesteps_are_split_with_their_tokens():
    """Wan 2.2's and LTX's per-token timesteps ``[B, N]`` (a modulation per token) at P=3: split as
    their sequence, exact."""
    for out in run_distributed(_per_token_timesteps, 3, timeout=600):
        for case, (loss, grad) in out.items():
            assert loss <= EXACT["loss"] and grad <= EXACT["grad"], (case, loss, grad)


@pytest.mark.parametrize("extra", [{}, {"ep": "an expert group"}], ids=["mesh with tp", "ep given"])
def test_tensor_or_expert_parallelism_with_a_dit_is_refused(extra):
    """A diffusers transformer on a tp2 x sp2 mesh, or with expert parallelism asked for: Refused by
    name before anything is split (a fake process group: no collective runs)."""
    import seqpar
    from seqpar import compat
    from seqpar.errors import Refused
    from seqpar.testing.diffusers_zoo import build_dit

    model = build_dit("WanTransformer3DModel")
    with compat.fake_process_group(0, 4):
        mesh = seqpar.init_mesh(tp=2, sp=2) if not extra else seqpar.init_mesh(sp=4)
        with pytest.raises(Refused, match="diffusers transformer runs sequence parallelism alone"):
            seqpar.parallelize(model, mesh, **extra)
    assert seqpar.integrations.state.state_of(model) is None  # nothing was done to it
