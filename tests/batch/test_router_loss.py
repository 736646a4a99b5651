"""The MoE router aux loss across SP ranks (seqpar.batch.router_loss), without a model: each rank's
sums of its own tokens, all-reduced before the product, against the loss of the whole batch -- the
float64 oracle (seqpar.testing.router64) and transformers' own load_balancing_loss_func -- in value
on every rank and in gradient (averaged over the ranks, as DDP / sync_gradients do), at P = 1..4,
padded and packed rows, odd lengths, contiguous and zigzag layouts (4 gloo processes, one start)."""

import pytest
import torch

from seqpar import compat
from seqpar.batch.local_batch import BATCH_KWARG
from seqpar.batch.router_loss import aux_from_sums, product_key_sums, reduce_sums, switch_sums
from seqpar.batch.sharding import shard_batch
from seqpar.comm.launch import run_distributed
from seqpar.integrations.hf.router_losses import _local_keep
from seqpar.testing.model_parity import sp_meshes
from seqpar.testing.router64 import switch_aux

pytestmark = pytest.mark.distributed

L, B, E, K = 3, 2, 6, 2  # router layers, rows, experts, top-k
CASES = [(kind, s, layout) for kind in ("padded", "packed") for s in (13, 8) for layout in ("contiguous", "zigzag")]


def _batch(kind: str, s: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(B * s).view(B, s) % 50
    if kind == "padded":
        mask = torch.ones(B, s, dtype=torch.long)
        mask[1, s - s // 3:] = 0  # the second row right-padded
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}
    pos = torch.cat([torch.arange(s // 3), torch.arange(s - s // 3)]).expand(B, s)  # two documents a row
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}


def _mine(local, s: int) -> torch.Tensor:
    """The original token indices this rank holds, in its layout order."""
    shard = local[BATCH_KWARG].shard
    order = shard.positions if shard.positions is not None else torch.arange(s)
    start = sum(shard.seq_lens[:local[BATCH_KWARG].sp_rank])
    return order[start:start + local[BATCH_KWARG].local_len].cpu()


def _run(rank, world):
    torch.set_num_threads(1)
    out = []
    for p, mesh in sp_meshes(world, (1, 2, 3, 4)).items():
        if mesh is None:
            continue
        group = mesh.get_group("sp")
        for kind, s, layout in CASES:
            g = torch.Generator().manual_seed(s)
            full = torch.randn(L, B, s, E, generator=g, dtype=torch.float64, requires_grad=True)  # same on every rank
            batch = _batch(kind, s)
            local = shard_batch(batch, mesh, layout=layout)
            idx = _mine(local, s)
            gates = [full[i][:, idx].reshape(-1, E) for i in range(L)]  # [B*S_local, E] per layer
            whole, _ = reduce_sums(switch_sums(gates, K, _local_keep(local[BATCH_KWARG])), group)
            aux = aux_from_sums(whole)
            aux.backward()
            grad = full.grad.clone()
            torch.distributed.all_reduce(grad, group=group)
            grad /= p  # the average over the sp ranks
            out.append(((p, kind, s, layout), float(aux.detach()), grad))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_run, 4, timeout=300)


def _oracle(kind, s):
    g = torch.Generator().manual_seed(s)
    full = torch.randn(L, B, s, E, generator=g, dtype=torch.float64, requires_grad=True)
    mask = _batch(kind, s).get("attention_mask")
    aux = switch_aux([full[i].reshape(-1, E) for i in range(L)], K, None if mask is None else mask.reshape(-1) > 0)
    aux.backward()
    return full, mask, aux.detach(), full.grad


def test_every_rank_has_the_whole_batch_loss_and_gradient(runs):
    seen = set()
    for rank, rows in enumerate(runs):
        for (p, kind, s, layout), value, grad in rows:
            _, _, aux, ref_grad = _oracle(kind, s)
            assert abs(value - float(aux)) <= 1e-13, (rank, p, kind, s, layout, value, float(aux))
            assert float((grad - ref_grad).abs().max()) <= 1e-14, (rank, p, kind, s, layout)
            seen.add(p)
    assert seen == {1, 2, 3, 4}


def test_the_oracle_is_transformers_load_balancing_loss():
    """transformers' function sums in float32 (`.float()`): equal to float32 precision, not better."""
    from transformers.models.mixtral.modeling_mixtral import MixtralForCausalLM

    fn = compat.load_balancing_loss_func(MixtralForCausalLM)
    for kind, s, _ in CASES:
        full, mask, aux, _ = _oracle(kind, s)
        theirs = fn(tuple(full[i].detach().reshape(-1, E) for i in range(L)), E, K, mask)
        assert abs(float(theirs) - float(aux)) <= 1e-6 * float(aux), (kind, s, float(theirs), float(aux))
        local = aux_from_sums(switch_sums([full[i].detach().reshape(-1, E) for i in range(L)], K,
                                          None if mask is None else mask.bool()))
        assert abs(float(local) - float(aux)) <= 1e-14  # one rank, no collective: the oracle's value


def test_product_key_rule_is_doges_function():
    """Doge's own function computes in the logits' dtype, so it is a float64 oracle itself."""
    from transformers.models.doge.modeling_doge import DogeForCausalLM

    fn = compat.load_balancing_loss_func(DogeForCausalLM)
    g = torch.Generator().manual_seed(0)
    keys, s = 3, 7
    logits = [torch.randn(2, B * s, keys, generator=g, dtype=torch.float64) for _ in range(L)]
    mask = torch.ones(B, s, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    ours = aux_from_sums(product_key_sums(logits, K, mask.bool()))
    assert abs(float(ours) - float(fn(tuple(logits), keys * keys, keys, K, mask))) <= 1e-14


def test_grad_scale_multiplies_the_local_gradient_only():
    x = torch.rand(E, dtype=torch.float64, requires_grad=True)
    sums = switch_sums([x.view(1, E)], K, None)
    whole, flags = reduce_sums(sums, None, grad_scale=2.0, flags=1.0)
    assert float(flags) == 1.0 and torch.equal(whole.probs.detach(), sums.probs.detach())
    aux_from_sums(whole).backward()
    once = x.grad.clone()
    x.grad = None
    aux_from_sums(switch_sums([x.view(1, E)], K, None)).backward()
    assert torch.equal(once, 2 * x.grad)

