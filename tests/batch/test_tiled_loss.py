"""The tiled logits + loss (issue 11) in one process, float64: against the untiled logits and
cross entropy (loss 1e-10, every gradient 1e-9), and reduce_memory on whole models against the
float64 reference (loss 1e-9, gradients 1e-8); then what reduce_memory refuses."""

import copy

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar.batch.loss import token_losses
from seqpar.batch.targets import IGNORE_INDEX
from seqpar.batch.tiled_loss import Head, tiled_log_probs, tiled_loss_sum, tiled_token_stats
from seqpar.integrations.models import build_model
from seqpar.testing.model_parity import ModelCase, case_batch, make_model, reference_grads

LOSS_TOL, GRAD_TOL = 1e-10, 1e-9
B, S, H, V = 2, 11, 8, 23
HEADS = {"plain": {}, "bias": {"bias": True}, "softcap": {"softcap": 1.5}, "scale": {"scale": 0.3},
         "divide": {"divide": 4.0}, "all": {"bias": True, "scale": 1.7, "divide": 2.5, "softcap": 3.0}}


def _inputs(seed: int, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    targets = torch.randint(0, V, (B, S), generator=g)
    targets[0, 3] = targets[1, -1] = targets[1, 0] = IGNORE_INDEX
    weights = torch.rand(B, S, generator=g, dtype=torch.float64)
    return hidden, weight, b, targets, weights


def _untiled_logits(hidden, weight, bias, scale=None, divide=None, softcap=None):
    z = F.linear(hidden, weight, bias)  # [B, S, V], as a model computes it
    if scale is not None:
        z = z * scale
    if divide is not None:
        z = z / divide
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


def _grads(out, tensors):
    return torch.autograd.grad(out, [t for t in tensors if t is not None])


@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("tile", [1, 7, B * S, 1000])
@pytest.mark.parametrize("weighted", [False, True])
def test_tiled_loss_equals_untiled(kind, tile, weighted):
    opts = dict(HEADS[kind])
    hidden, weight, bias, targets, weights = _inputs(tile, opts.pop("bias", False))
    w = weights if weighted else None
    ref = token_losses(_untiled_logits(hidden, weight, bias, **opts), targets)
    ref = (ref * w if weighted else ref).sum() * 0.37  # a downstream scale, as the token mean applies
    mine = tiled_loss_sum(hidden, Head(weight, bias, **opts), targets, token_weights=w, tile=tile) * 0.37
    assert abs(float((mine - ref).detach())) <= LOSS_TOL
    for a, b in zip(_grads(mine, (hidden, weight, bias)), _grads(ref, (hidden, weight, bias)), strict=True):
        assert float((a - b).abs().max()) <= GRAD_TOL


@pytest.mark.parametrize("tile", [1, 5, 1000])
def test_tiled_log_probs_and_stats_equal_untiled(tile):
    hidden, weight, bias, targets, _ = _inputs(7, bias=True)
    head = Head(weight, bias, softcap=2.0)
    z = _untiled_logits(hidden, weight, bias, softcap=2.0)
    valid = targets != IGNORE_INDEX
    ref = torch.log_softmax(z, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1) * valid
    mine = tiled_log_probs(hidden, head, targets, tile=tile)
    assert float((mine - ref).abs().max()) <= LOSS_TOL
    g = torch.randn(B, S, dtype=torch.float64)  # a per-token upstream gradient (DPO, RL)
    for a, b in zip(_grads((mine * g).sum(), (hidden, weight, bias)), _grads((ref * g).sum(), (hidden, weight, bias)),
                    strict=True):
        assert float((a - b).abs().max()) <= GRAD_TOL
    losses, correct = tiled_token_stats(hidden.detach(), head, targets, tile=tile)
    assert float((losses - token_losses(z, targets)).abs().max()) <= LOSS_TOL
    assert torch.equal(correct, (z.argmax(-1) == targets) & valid)


def test_no_grad_forward_computes_no_gradient():
    hidden, weight, _, targets, _ = _inputs(3)
    with torch.no_grad():
        out = tiled_loss_sum(hidden, Head(weight), targets, tile=4)
    assert not out.requires_grad
    ref = token_losses(_untiled_logits(hidden, weight, None), targets).sum()
    assert abs(float(out - ref)) <= LOSS_TOL


def _model(name="tiny-llama", tied=False, **overrides):
    if overrides:  # a config make_model does not know: draw its weights the same way
        torch.manual_seed(0)
        model, _ = build_model(name, dtype=torch.float64, **overrides)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_((1.0 + 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64)) if p.dim() == 1 else
                        torch.randn(p.shape, generator=g, dtype=torch.float64) * (1.5 / p.shape[-1] ** 0.5))
    else:
        model = make_model(ModelCase(model=name))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.train()


def _other_models():
    import transformers as tf

    small = dict(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8, attention_dropout=0.0)
    cohere = tf.AutoModelForCausalLM.from_config(tf.CohereConfig(**small, logit_scale=0.3), attn_implementation="sdpa")
    granite = tf.AutoModelForCausalLM.from_config(tf.GraniteConfig(**small, logits_scaling=3.0),
                                                  attn_implementation="sdpa")
    return {"cohere": cohere.double().train(), "granite": granite.double().train()}


def _check_model(model, batch, **switches):
    """reduce_memory on a copy of ``model`` against its float64 reference: (loss diff, worst grad diff)."""
    ref_loss, ref_grads = reference_grads(model, batch)
    mine = seqpar.reduce_memory(copy.deepcopy(model), **switches)
    out = mine(**batch, use_cache=False)
    assert out.logits.shape[1] == 1  # the last token only: no [S, V] logits were made
    out.loss.backward()
    worst = max(float((q.grad - ref_grads[n]).abs().max()) for n, q in mine.named_parameters())
    return abs(float(out.loss.detach()) - ref_loss), worst


@pytest.mark.parametrize("name,tied,checkpoint", [("tiny-llama", False, "layers"), ("tiny-llama", True, "offload"),
                                                  ("tiny-gemma2", False, "layers"), ("tiny-qwen3", True, "none")])
def test_whole_model_without_sharding_matches_reference(name, tied, checkpoint):
    model = _model(name, tied)
    for batch_kind, seq in (("padded", 13), ("plain", 9)):
        batch = case_batch(ModelCase(batch=batch_kind, seq=seq), model.config.vocab_size)
        loss_diff, grad_diff = _check_model(model, batch, checkpoint=checkpoint, loss_tile=4, mlp_tile=3)
        assert loss_diff <= 1e-9 and grad_diff <= 1e-8, (name, batch_kind, loss_diff, grad_diff)


def test_logit_scaling_models_match_reference():
    for name, model in _other_models().items():
        batch = case_batch(ModelCase(batch="padded", seq=10), model.config.vocab_size)
        loss_diff, grad_diff = _check_model(model, batch, loss_tile=3, mlp_tile=4)
        assert loss_diff <= 1e-9 and grad_diff <= 1e-8, (name, loss_diff, grad_diff)
        assert ("scale=0.3" if name == "cohere" else "divide=3.0") in seqpar.memory_switches(
            seqpar.reduce_memory(copy.deepcopy(model)))["head"]


def test_num_items_in_batch_and_token_stats():
    model = _model()
    batch = case_batch(ModelCase(batch="padded", seq=12), model.config.vocab_size)
    mine = seqpar.reduce_memory(copy.deepcopy(model), loss_tile=5)
    loss = mine(**batch, use_cache=False, num_items_in_batch=40).loss
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.detach()
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    per_token = token_losses(logits, targets)
    assert abs(float(loss) - float(per_token.sum() / 40)) <= LOSS_TOL
    stats = seqpar.token_stats(mine, batch)
    assert float((stats.losses - per_token).abs().max()) <= LOSS_TOL
    assert torch.equal(stats.correct, (logits.argmax(-1) == targets) & (targets != IGNORE_INDEX))
    assert torch.equal(stats.valid, targets != IGNORE_INDEX)
    assert model(**batch).logits.shape[1] == batch["input_ids"].shape[1]  # without labels: full logits


def test_restore_memory_gives_the_model_back():
    model = _model()
    keys = list(model.state_dict())
    loss_fn = model.loss_function
    mine = seqpar.reduce_memory(model, checkpoint="offload")
    assert list(mine.state_dict()) == keys
    assert "no-op on the CPU" in seqpar.memory_switches(mine)["offload"]
    twin = copy.deepcopy(mine)  # a deep copy runs its own modules, not the original's
    batch = case_batch(ModelCase(batch="plain", seq=8), model.config.vocab_size)
    twin(**batch).loss.backward()
    assert all(q.grad is None for q in model.parameters()) and all(q.grad is not None for q in twin.parameters())
    seqpar.restore_memory(mine)
    assert seqpar.memory_switches(mine) == {"tiled_loss": False, "tiled_mlp": False, "checkpoint": "none"}
    assert all("forward" not in m.__dict__ for m in mine.modules())
    assert mine.loss_function == loss_fn
    assert mine(**batch).logits.shape[1] == 8


def _scaled_output(_module, _args, out):
    return out * 2.0


def test_refusals():
    model = _model()
    for kwargs, words in (({"loss_tile": 0}, "loss_tile=0"), ({"mlp_tile": -3}, "mlp_tile=-3"),
                          ({"loss_tile": 2.5}, "loss_tile=2.5"), ({"mlp_tile": True}, "mlp_tile=True"),
                          ({"checkpoint": "disk"}, "checkpoint='disk'")):
        with pytest.raises(ValueError, match=words):
            seqpar.reduce_memory(model, **kwargs)
    seqpar.reduce_memory(model)
    with pytest.raises(ValueError, match="already"):
        seqpar.reduce_memory(model)
    seqpar.restore_memory(model)

    odd = copy.deepcopy(model)
    odd.lm_head = torch.nn.Sequential(odd.lm_head)
    with pytest.raises(ValueError, match="Sequential.*tiled_loss=False"):
        seqpar.reduce_memory(odd)
    moe, _ = build_model("tiny-llama", dtype=torch.float64)
    moe.model.layers[1].mlp = torch.nn.Sequential(torch.nn.Linear(32, 32))  # not a known per-token MLP
    with pytest.raises(ValueError, match="Sequential is not a module seqpar knows to be per-token"):
        seqpar.reduce_memory(moe)
    seqpar.reduce_memory(moe, tiled_mlp=False)  # the rest still works
    no_mlp = copy.deepcopy(model)
    for layer in no_mlp.model.layers:
        del layer.mlp
    with pytest.raises(ValueError, match="no MLP found"):
        seqpar.reduce_memory(no_mlp)

    # offload needs pinned host memory for a model on an accelerator: a host without a pinned allocator
    # (this CPU build) refuses; a CPU model needs none (its offload is plain checkpoints, see above)
    with torch.device("meta"):
        on_device = type(model)(model.config)
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        with pytest.raises(ValueError, match="checkpoint='offload' needs pinned host memory.*checkpoint='layers'"):
            seqpar.reduce_memory(on_device, checkpoint="offload")
    else:
        assert "pinned host memory" in seqpar.memory_switches(seqpar.reduce_memory(on_device, checkpoint="offload"))[
            "offload"]

    # a head that transforms the logits in a way seqpar does not know: refused at the first call
    hooked = copy.deepcopy(model)
    hooked.lm_head.register_forward_hook(_scaled_output)
    seqpar.reduce_memory(hooked)
    batch = case_batch(ModelCase(batch="plain", seq=8), model.config.vocab_size)
    with pytest.raises(ValueError, match="LlamaForCausalLM's logits are not its head's output"):
        hooked(**batch)
