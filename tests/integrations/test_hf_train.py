"""Training with seqpar on a 2 x 2 (dp x sp) mesh, 4 processes, float64: gradients and one AdamW
step equal the single-process run of the same global batch, with sync_gradients, FSDP2 and DDP,
under gradient accumulation over micro-batches with different token counts, and with the default
per-dp-rank mean (DDP's average of means)."""

import copy

import pytest
import torch

import seqpar
from seqpar.comm.launch import run_distributed
from seqpar.testing.model_parity import ModelCase, case_batch, make_model, reference_token_loss

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes

MODES = ["sync", "fsdp", "ddp", "mean"]
TOL = 1e-8


def _micro_batches(dp_rank: int, vocab: int) -> list[dict]:
    """Two micro-batches per dp rank, of different shapes and token counts (padded / packed)."""
    kinds = [("padded", 16), ("packed", 13)] if dp_rank == 0 else [("packed", 17), ("padded", 11)]
    return [case_batch(ModelCase(batch=b, seq=s, seed=10 * dp_rank + i), vocab) for i, (b, s) in enumerate(kinds)]


def _full(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(params, lr=1e-3):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


def _reference(model, batches_per_dp, mode):
    """Single process: the same loss on the whole global batch, its gradients, one AdamW step."""
    if mode == "mean":  # each dp rank's own token mean (one micro-batch), averaged over dp
        losses = []
        for mbs in batches_per_dp:
            total, n = reference_token_loss(model, mbs[0])
            losses.append(total / n)
        loss = sum(losses) / len(losses)
    else:  # one token mean over every micro-batch of every dp rank
        sums, count = [], 0
        for mbs in batches_per_dp:
            for b in mbs:
                total, n = reference_token_loss(model, b)
                sums.append(total)
                count += n
        loss = sum(sums) / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt = _step(model.parameters())
    opt.step()
    return float(loss.detach()), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, world):
    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=2, dp=2, device_type="cpu")
    dp_rank = mesh.get_local_rank("dp")
    base = make_model(ModelCase(model="tiny-llama"))
    vocab = base.config.vocab_size
    batches = [_micro_batches(d, vocab) for d in range(2)]
    out = {}
    for mode in MODES:
        ref_loss, ref_grads, ref_params = _reference(copy.deepcopy(base), batches, mode)
        model = seqpar.parallelize(copy.deepcopy(base), mesh)
        runner = model
        if mode == "fsdp":
            runner = seqpar.apply_fsdp(model, mesh)
        elif mode == "ddp":
            runner = seqpar.apply_ddp(model, mesh)
        mine = batches[dp_rank][:1] if mode == "mean" else batches[dp_rank]
        n_items = None if mode == "mean" else seqpar.count_target_tokens(mine, mesh)
        losses = []
        for i, b in enumerate(mine):
            local = seqpar.shard_batch(b, mesh, num_items_in_batch=n_items)
            if mode == "ddp" and i < len(mine) - 1:
                with runner.no_sync():
                    loss = runner(**local).loss
                    loss.backward()
            else:
                loss = runner(**local).loss
                loss.backward()
            losses.append(float(loss.detach()))
        if mode in ("sync", "mean"):
            seqpar.sync_gradients(model, mesh)
        params = dict(model.named_parameters())
        grad_err = max(float((_full(params[n].grad) - g).abs().max()) for n, g in ref_grads.items())
        _step(model.parameters()).step()
        param_err = max(float((_full(params[n].detach()) - p).abs().max()) for n, p in ref_params.items())
        # the loss each rank reports: its dp rank's share of the step (summing them gives the global loss)
        out[mode] = {"grad": grad_err, "param": param_err, "losses": losses, "ref_loss": ref_loss,
                     "n_items": n_items}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=300)


@pytest.mark.parametrize("mode", MODES)
def test_gradients_and_step_match_single_process(results, mode):
    for rank, res in enumerate(results):
        r = res[mode]
        assert r["grad"] <= TOL, f"rank {rank} {mode}: max grad diff {r['grad']:.2e}"
        assert r["param"] <= TOL, f"rank {rank} {mode}: max param diff after AdamW {r['param']:.2e}"


def test_loss_values_add_up_to_the_global_loss(results):
    # dp rank d = ranks {2d, 2d+1}; both SP ranks of a dp rank report the same loss
    for mode in ("sync", "fsdp", "ddp"):
        per_dp = [results[0][mode]["losses"], results[2][mode]["losses"]]
        assert results[1][mode]["losses"] == per_dp[0] and results[3][mode]["losses"] == per_dp[1]
        total = sum(sum(x) for x in per_dp)
        assert abs(total - results[0][mode]["ref_loss"]) <= 1e-9
        assert results[0][mode]["n_items"] == results[3][mode]["n_items"]
    per_dp = [results[0]["mean"]["losses"][0], results[2]["mean"]["losses"][0]]
    assert abs(sum(per_dp) / 2 - results[0]["mean"]["ref_loss"]) <= 1e-9
