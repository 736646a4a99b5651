"""The SP loss without a model: per-token losses, the global mean with local-only gradients (weights,
num_items_in_batch, no targets), gather_log_probs with autograd, and sync_gradients -- against the
same quantities on the unsharded tensors (float64, 3 gloo processes). Gradients are averaged over
the ranks, as DDP / FSDP2 / sync_gradients do: each rank's share is scaled for that average."""

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar.attention.layout import layout_indices
from seqpar.attention.shard import SeqShard
from seqpar.batch.local_batch import BATCH_KWARG, LocalBatch
from seqpar.batch.loss import _GlobalTokenMean, make_loss_function, token_losses
from seqpar.batch.targets import prepare_batch
from seqpar.comm.launch import run_distributed

P, B, S, V = 3, 2, 10, 7


def test_token_losses_match_cross_entropy_and_keep_float64():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    targets = torch.tensor([[1, 2, -100, 4, 5], [0, -100, -100, 9, 10]])
    got = token_losses(logits, targets)
    assert got.dtype == torch.float64 and got.shape == (2, 5)
    ref = F.cross_entropy(logits.view(-1, 11), targets.view(-1), reduction="none", ignore_index=-100).view(2, 5)
    assert torch.equal(got, ref)
    assert token_losses(logits.bfloat16(), targets).dtype == torch.float32  # low precision is upcast


def test_global_mean_value_and_local_gradient():
    x = torch.tensor(6.0, dtype=torch.float64, requires_grad=True)
    y = _GlobalTokenMean.apply(x, None, 3.0, 0.25)
    assert float(y.detach()) == 2.0
    y.backward()
    assert float(x.grad) == 0.25  # the grad scale, not 1/N: the dp average may be folded in


def _full():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 7:] = 0
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask,
            "loss_weights": torch.rand(B, S, generator=g, dtype=torch.float64)}, \
        torch.randn(B, S, V, generator=g, dtype=torch.float64)


def _worker(rank, world):
    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    group = mesh.get_group("sp")
    loss_fn = make_loss_function(mesh)
    out = {}
    batch, logits_full = _full()
    logits, labels = torch.zeros(1, 3, V), torch.zeros(1, 3, dtype=torch.long)
    untrusted = LocalBatch(SeqShard((1,) * world), sp_rank=rank, sp_size=world, dp_size=1, denominator=3,
                           num_items_in_batch=None, loss_weights=None)
    for name, kw in (("no batch", {}), ("attention never ran", {BATCH_KWARG: untrusted})):
        try:
            loss_fn(logits, labels, V, **kw)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    for layout in ("contiguous", "zigzag"):
        for variant in ("weighted", "plain", "num_items", "no targets"):
            b = dict(batch)
            if variant != "weighted":
                b.pop("loss_weights")
            if variant == "no targets":
                b["labels"] = torch.full_like(b["labels"], -100)
            local = seqpar.shard_batch(b, mesh, layout=layout)
            info = local[BATCH_KWARG]
            info.attention_calls = 1  # no model here: vouch that attention ran
            full = logits_full.clone().requires_grad_(True)
            idx = layout_indices(S, world, layout)[rank]
            kw = {"num_items_in_batch": torch.tensor(40.0)} if variant == "num_items" else {}
            loss = loss_fn(logits=full[:, idx], labels=local["labels"], vocab_size=V,
                           shift_labels=local["shift_labels"], **{BATCH_KWARG: info}, **kw)
            loss.backward()
            grad = full.grad.clone()
            torch.distributed.all_reduce(grad, group=group)  # what sync_gradients / DDP do for parameters:
            grad /= world                                     # the average over the ranks
            out[(layout, variant)] = (float(loss.detach()), grad)
        # gather_log_probs: every rank computes the same loss from the whole sequence's log-probs
        local = seqpar.shard_batch(batch, mesh, layout=layout)
        full = logits_full.clone().requires_grad_(True)
        idx = layout_indices(S, world, layout)[rank]
        logp = seqpar.gather_log_probs(full[:, idx], local, mesh)
        weights = torch.linspace(0.5, 2.0, S, dtype=torch.float64)
        (logp * weights).sum().backward()
        grad = full.grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        out[(layout, "logp")] = (logp.detach(), grad / world)
    # sync_gradients: averages over sp (and dp); parameters without a gradient count as zeros
    lin = torch.nn.Linear(2, 2, dtype=torch.float64)
    lin.weight.grad = torch.full_like(lin.weight, float(rank + 1))
    seqpar.sync_gradients(lin, mesh)
    out["sync"] = (lin.weight.grad.clone(), lin.bias.grad.clone())
    return out


def _reference(variant):
    batch, logits = _full()
    if variant != "weighted":
        batch.pop("loss_weights")
    if variant == "no targets":
        batch["labels"] = torch.full_like(batch["labels"], -100)
    prep = prepare_batch(batch)
    logits = logits.clone().requires_grad_(True)
    ce = token_losses(logits, prep.targets)
    if prep.weights is not None:
        ce = ce * prep.weights
    n = 40.0 if variant == "num_items" else (float(prep.weights.sum()) if prep.weights is not None else
                                             float((prep.targets != -100).sum()))
    loss = ce.sum() / max(n, 1.0)
    loss.backward()
    return float(loss.detach()), logits.grad


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, P, timeout=120)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("variant", ["weighted", "plain", "num_items", "no targets"])
def test_sp_loss_is_the_global_mean_with_exact_gradients(ranks, layout, variant):
    ref_loss, ref_grad = _reference(variant)
    for r in ranks:
        loss, grad = r[(layout, variant)]
        assert abs(loss - ref_loss) <= 1e-12
        assert float((grad - ref_grad).abs().max()) <= 1e-12
    if variant == "no targets":
        assert ref_loss == 0.0


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_gather_log_probs_whole_sequence_in_token_order(ranks, layout):
    batch, logits = _full()
    prep = prepare_batch(batch)
    logits = logits.clone().requires_grad_(True)
    valid = prep.targets != -100
    ref = torch.log_softmax(logits, -1).gather(-1, prep.targets.clamp(min=0)[..., None])[..., 0] * valid
    (ref * torch.linspace(0.5, 2.0, S, dtype=torch.float64)).sum().backward()
    for r in ranks:
        logp, grad = r[(layout, "logp")]
        assert logp.shape == (B, S)
        assert float((logp - ref.detach()).abs().max()) <= 1e-12
        assert float((grad - logits.grad).abs().max()) <= 1e-12  # each rank's slice once, not P times or 1/P


@pytest.mark.distributed
def test_loss_function_refuses_a_batch_it_cannot_trust(ranks):
    for r in ranks:
        assert "shard_batch" in r["no batch"]
        assert "never went through seqpar" in r["attention never ran"]


@pytest.mark.distributed
def test_sync_gradients_averages_and_fills_missing(ranks):
    for r in ranks:
        w, b = r["sync"]
        assert torch.equal(w, torch.full((2, 2), sum(range(1, P + 1)) / P, dtype=torch.float64))
        assert torch.equal(b, torch.zeros(2, dtype=torch.float64))
