"""A parallelized model under the *stock* data-parallel wrappers, which average the gradients over
their ranks: every parameter's gradient equals the unparallelized model's (float64, tiny Llama, 4
gloo processes), on a dp=2 x sp=2 mesh and on sp=4, with gradient accumulation over micro-batches
of different token counts (``num_items_in_batch`` over the step) and with per-dp-rank means.

    stock DDP             DistributedDataParallel(model): the world, default averaging
    stock fully_shard     fully_shard per decoder layer, then the root, on a 1-D mesh over all ranks
    HSDP                  fully_shard on seqpar's own 2-D (dp, sp) mesh: replicate x shard
    accelerate FSDP2      accelerate's own fsdp2_prepare_model (per layer, embeddings, the tail
                          group, the root); accelerate's Accelerator picks DDP on a CPU, so its
                          FSDP2 wrapping is called directly (see test_accelerate_fsdp2_wrapping)

A wrapper that averages over the dp ranks only (fully_shard on the dp axis, DDP over the dp group)
is refused with seqpar.Refused at the first training forward, on every rank, before any gradient.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch

from seqpar.comm.launch import run_distributed
from seqpar.testing.model_parity import ModelCase, case_batch, make_model, reference_token_loss

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes

WORLD = 4
TOL = 1e-12
MESHES = {"dp2xsp2": 2, "sp4": 1}  # name: dp (sp4 in the heavy grid: its own 4 workers, ~30 s more here)
MODES = ["ddp", "ddp_mean", "fully_shard", "hsdp", "accelerate_fsdp2"]
WRONG = ["fully_shard_dp", "ddp_dp"]


def _micro_batches(dp_rank: int, vocab: int) -> list[dict]:
    """Two micro-batches per dp rank, of different shapes and token counts (padded / packed)."""
    kinds = [("padded", 16), ("packed", 13)] if dp_rank == 0 else [("packed", 17), ("padded", 11)]
    return [case_batch(ModelCase(batch=b, seq=s, seed=10 * dp_rank + i), vocab) for i, (b, s) in enumerate(kinds)]


def _reference(base, batches_per_dp, mean: bool) -> dict[str, torch.Tensor]:
    """Single process: the gradients of one token mean over every micro-batch of every dp rank, or
    (``mean``) of the dp ranks' own token means of their first micro-batch, averaged."""
    model = copy.deepcopy(base)
    if mean:
        losses = [total / n for total, n in (reference_token_loss(model, mbs[0]) for mbs in batches_per_dp)]
        loss = sum(losses) / len(losses)
    else:
        parts = [reference_token_loss(model, b) for mbs in batches_per_dp for b in mbs]
        loss = sum(t for t, _ in parts) / sum(n for _, n in parts)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _wrap(mode: str, model, mesh):
    """``model`` (parallelized) under the wrapper of ``mode``; returns the module to call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from seqpar import compat

    if mode in ("ddp", "ddp_mean"):
        return torch.nn.parallel.DistributedDataParallel(model)
    if mode == "ddp_dp":
        return torch.nn.parallel.DistributedDataParallel(model, process_group=mesh.get_group("dp"))
    if mode == "accelerate_fsdp2":
        from accelerate import FullyShardedDataParallelPlugin
        from accelerate.utils import fsdp2_prepare_model

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                cpu_ram_efficient_loading=False)
        accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                      device=torch.device("cpu"), is_main_process=False, mixed_precision="no")
        return fsdp2_prepare_model(accelerator, model)  # its mesh: fully_shard's default, the world
    flat = {"fully_shard": lambda: init_device_mesh("cpu", (WORLD,), mesh_dim_names=("all",)),
            "hsdp": lambda: mesh, "fully_shard_dp": lambda: mesh["dp"]}[mode]()
    blocks = compat.decoder_block_classes(model)
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=flat)
    return fully_shard(model, mesh=flat)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(mode: str, base, mesh, mine: list[dict], n_items) -> dict[str, torch.Tensor]:
    """Forward and backward of this rank's micro-batches under ``mode``'s wrapper, gradients
    reduced once (after the last); returns every parameter's (full) gradient."""
    import seqpar

    model = seqpar.parallelize(copy.deepcopy(base), mesh)
    runner = _wrap(mode, model, mesh)
    for i, b in enumerate(mine):
        last = i == len(mine) - 1
        local = seqpar.shard_batch(b, mesh, num_items_in_batch=n_items)
        if hasattr(runner, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter once per step
            runner.set_requires_gradient_sync(last)
        sync = runner.no_sync() if hasattr(runner, "no_sync") and not last else contextlib.nullcontext()
        with sync:
            runner(**local).loss.backward()
    return {n: _full(p.grad) for n, p in model.named_parameters()}


def _refused(mode: str, base, mesh, batch: dict) -> tuple[str | None, bool]:
    """(the Refused message or None, whether any parameter got a gradient) under a wrapper that
    averages over the dp ranks only."""
    import seqpar

    model = seqpar.parallelize(copy.deepcopy(base), mesh)
    runner = _wrap(mode, model, mesh)
    try:
        runner(**seqpar.shard_batch(batch, mesh)).loss.backward()
        message = None
    except seqpar.Refused as e:
        message = str(e)
    return message, any(p.grad is not None for p in model.parameters())


def _worker(rank: int, world: int, name: str) -> dict:
    torch.set_num_threads(1)
    import seqpar

    base = make_model(ModelCase(model="tiny-llama"))
    vocab = base.config.vocab_size
    dp = MESHES[name]
    mesh = seqpar.init_mesh(sp=world // dp, dp=dp, device_type="cpu")
    dp_rank = mesh.get_local_rank("dp") if dp > 1 else 0
    batches = [_micro_batches(d, vocab) for d in range(dp)]
    refs = {mean: _reference(base, batches, mean) for mean in (False, True)}
    out: dict = {}
    for mode in MODES:
        mean = mode == "ddp_mean"  # no num_items_in_batch: each dp rank's own token mean
        mine = batches[dp_rank][:1] if mean else batches[dp_rank]
        n_items = None if mean else seqpar.count_target_tokens(mine, mesh)
        grads = _train(mode, base, mesh, mine, n_items)
        out[mode] = max(float((grads[n] - g).abs().max()) for n, g in refs[mean].items())
    for mode in WRONG:
        out[mode] = _refused(mode, base, mesh, batches[dp_rank][0])
    return out


@pytest.fixture(scope="module", params=["dp2xsp2", pytest.param("sp4", marks=pytest.mark.heavy)])
def results(request):
    """(the mesh's name, every rank's results)."""
    return request.param, run_distributed(_worker, WORLD, request.param, timeout=600)


@pytest.mark.parametrize("mode", MODES)
def test_stock_wrapper_gives_the_unparallelized_gradients(results, mode):
    mesh, ranks = results
    for rank, res in enumerate(ranks):
        err = res[mode]
        assert err <= TOL, f"rank {rank} {mesh} {mode}: max gradient difference {err:.3g}"


@pytest.mark.parametrize("mode", WRONG)
def test_wrapper_over_dp_only_is_refused_on_every_rank_before_any_gradient(results, mode):
    mesh, ranks = results
    messages = [res[mode] for res in ranks]
    for rank, (message, has_grad) in enumerate(messages):
        assert message is not None, f"rank {rank} {mesh} {mode}: not refused"
        assert "averages the gradients over ranks" in message and "seqpar.apply_fsdp" in message, message
        assert not has_grad, f"rank {rank} {mesh} {mode}: a gradient exists after the refusal"
    # each rank names its own dp group's ranks: the ranks of one group raise the same message
    what = "DistributedDataParallel" if mode == "ddp_dp" else "FSDP2"
    assert all(what in m for m, _ in messages)
