"""Router losses seqpar cannot make exact are refused, on every rank (seqpar.integrations.hf.router_losses):
a family whose aux loss is not the rule seqpar recomputes (simulated: a rule that reads one expert
per token where the model's own aux loss counts two) at its first forward,
a z-loss over the positions at parallelize."""

import pytest
import torch

from seqpar.comm.launch import run_distributed

pytestmark = pytest.mark.distributed


def _worker(rank, world):
    import seqpar
    from seqpar.batch import router_loss
    from seqpar.errors import Refused
    from seqpar.testing.zoo import build_tiny

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    out = {}
    model = build_tiny("mixtral")
    switch = router_loss.ROUTER_RULES["switch"]
    router_loss.ROUTER_RULES["switch"] = lambda logits, top_k, keep, dtype=None: switch(logits, 1, keep, dtype)
    try:
        seqpar.parallelize(model, mesh)
    finally:
        router_loss.ROUTER_RULES["switch"] = switch
    ids = torch.arange(22).view(2, 11) % 50
    try:
        model(**seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh))
        out["rule"] = None
    except Refused as e:
        out["rule"] = str(e)
    try:
        seqpar.parallelize(build_tiny("bamba", z_loss_coefficient=0.1, attn_layer_indices=[1]), mesh)
        out["z"] = None
    except Refused as e:
        out["z"] = str(e)
    return out


def test_refused_on_every_rank():
    outs = run_distributed(_worker, 2, timeout=300)
    for out in outs:
        assert out["rule"] is not None and "MixtralForCausalLM's router aux loss" in out["rule"], out
        assert "output_router_logits" in out["rule"], out
        assert out["z"] is not None and "z_loss_coefficient=0.1" in out["z"], out
