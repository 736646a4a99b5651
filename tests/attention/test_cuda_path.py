"""The CUDA path on one GPU (issue 14; marked ``gpu``, skipped without CUDA).

The README's API example with the DataLoader's CPU batch over an NCCL group (the communication
device is the GPU, the batch's is the CPU): loss and every gradient equal the plain model's.

No CUDA synchronization in the steady-state layers of a batch.

``torch.cuda.set_sync_debug_mode("error")`` makes every call that waits for the GPU queue raise
(``.item()``, a device-to-host copy, ``nonzero``, a blocking host-to-device copy...). It is on
while layers 2..L run forward and while layers L-1..1 run backward -- the first layer of a batch in
each direction may pay once for the batch's plans -- for Ulysses, ring and hybrid over a
one-rank NCCL group (the one GPU a lent machine has), with padded and packed rows in a permuted
layout, with the fused kernel and the tiled one. The CPU suite counts the same calls by name at
P = 4 (``test_host_syncs.py``); this is the GPU's own word on it.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from seqpar.testing.attention_layer import AttentionLayer

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def _batch(kind: str, s: int = 1024) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, s), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padded":
        mask = torch.ones(2, s, dtype=torch.long)
        mask[0, s - 300:] = 0
        mask[1, :17] = 0
        batch["attention_mask"] = mask
    else:  # packed documents
        docs = [300, 500, s - 800]
        batch["position_ids"] = torch.cat([torch.arange(n) for n in docs])[None].expand(2, s)
    return batch


@pytest.fixture(scope="module")
def meshes():
    import torch.distributed as dist

    from seqpar.comm.mesh import init_mesh

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield {"sp": init_mesh(sp=1), "hybrid": init_mesh(sp=1, ulysses=1, ring=1)}
    finally:
        dist.destroy_process_group()


def _steady(layers: nn.ModuleList) -> list:
    """Hooks that turn sync errors on for layers[1:] forward and layers[:-1] backward."""
    def mode(m):
        return lambda *args: torch.cuda.set_sync_debug_mode(m)

    return [layers[1].register_forward_pre_hook(mode("error")),
            layers[-1].register_forward_hook(mode("default")),
            layers[-2].register_full_backward_pre_hook(mode("error")),
            layers[0].register_full_backward_hook(mode("default"))]


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_cudnn", "flex", "tiled"])
@pytest.mark.parametrize("kind", ["padded", "packed"])
@pytest.mark.parametrize("strategy", ["ulysses", "ring", "hybrid"])
def test_steady_state_layers_do_not_sync(meshes, strategy, kind, kernel):
    from seqpar.batch.loss import sp_token_mean, token_losses
    from seqpar.batch.sharding import shard_batch
    from seqpar.comm.mesh import Axis, axis_group

    mesh = meshes["hybrid" if strategy == "hybrid" else "sp"]
    dtype = torch.bfloat16
    torch.manual_seed(0)
    emb = nn.Embedding(64, 256, dtype=dtype, device="cuda")
    layers = nn.ModuleList(AttentionLayer(256, 8, 2, 32, dtype) for _ in range(4)).cuda()
    head = nn.Linear(256, 64, dtype=dtype, device="cuda")
    for step in range(2):  # the second batch: nothing left over from the first
        local = shard_batch({k: v.cuda() for k, v in _batch(kind).items()}, mesh, layout="doc-zigzag"
                            if kind == "packed" else "zigzag")
        batch = local["seqpar_batch"]
        hooks = _steady(layers)
        try:
            x = emb(local["input_ids"])  # [B, S/P, E]
            for layer in layers:
                x = layer(x, mesh, strategy, batch.shard, kernel)
            loss = sp_token_mean(token_losses(head(x).float(), local["labels"]).sum(), batch,
                                 axis_group(mesh, Axis.SP.value))
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for h in hooks:
                h.remove()
        grads = [p.grad for p in layers.parameters()]
        assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads), (strategy, kind, step)
        layers.zero_grad()


@pytest.mark.parametrize("strategy", ["ulysses", "ring"])
def test_readme_example_with_cpu_batches_over_nccl(meshes, strategy):
    import seqpar
    from seqpar.integrations.models import build_model

    mesh = meshes["sp"]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (2, 301), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 250:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}  # a DataLoader's: on the CPU
    torch.manual_seed(0)
    plain = build_model("tiny-llama")[0].cuda()
    model = build_model("tiny-llama")[0].cuda()
    model.load_state_dict(plain.state_dict())
    want = plain(**{k: v.cuda() for k, v in batch.items()}).loss
    want.backward()

    seqpar.parallelize(model, mesh, strategy=strategy)
    seqpar.reduce_memory(model, mesh)
    local = seqpar.shard_batch(batch, mesh, device="cuda")  # the shard moves, once
    assert local["input_ids"].device.type == "cuda"
    loss = model(**local).loss
    loss.backward()
    seqpar.sync_gradients(model, mesh)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    theirs = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-6, msg=name)
