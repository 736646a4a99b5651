"""Pure pieces of the objectives, no processes: the tiled log-probs and entropy against full
``log_softmax`` (values and gradients, temperature, softcap, scaled heads, tiles that do not divide
the tokens), and the sequence numbering of a sharded batch."""

import pytest
import torch

from seqpar.attention.shard import SeqShard
from seqpar.batch.local_batch import LocalBatch
from seqpar.batch.tiled_loss import Head
from seqpar.objectives import token_logps_entropy
from seqpar.objectives.rows import local_tokens, sequences


@pytest.mark.parametrize("tile", [1, 4, 7, 1024])
@pytest.mark.parametrize("head_kind", ["plain", "softcap", "scaled"])
def test_tiled_logps_and_entropy_equal_full_log_softmax(tile, head_kind):
    g = torch.Generator().manual_seed(tile)
    hidden = torch.randn(2, 9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 9), generator=g)
    targets[0, :3] = -100
    kw = {"softcap": {"softcap": 3.0}, "scaled": {"scale": 0.7, "divide": 1.3}}.get(head_kind, {})
    head = Head(weight, bias, **kw)
    a, b = torch.rand(2, 9, generator=g, dtype=torch.float64), torch.rand(2, 9, generator=g, dtype=torch.float64)
    logp, ent = token_logps_entropy(hidden, head, targets, temperature=0.7, tile=tile)
    ((logp * a).sum() + (ent * b).sum()).backward()
    got = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    z = torch.nn.functional.linear(hidden, weight, bias)
    z = z * kw.get("scale", 1.0) / kw.get("divide", 1.0)
    if "softcap" in kw:
        z = torch.tanh(z / 3.0) * 3.0
    full = torch.log_softmax(z / 0.7, -1)  # [B, S, V]: the oracle may hold it
    ref_logp = full.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets != -100)
    ref_ent = -(full.exp() * full).sum(-1)
    ((ref_logp * a).sum() + (ref_ent * b).sum()).backward()
    assert float((logp - ref_logp).detach().abs().max()) < 1e-13
    assert float((ent - ref_ent).detach().abs().max()) < 1e-13
    for mine, t in zip(got, (hidden, weight, bias), strict=True):
        assert float((mine - t.grad).abs().max()) < 1e-12


def test_a_bad_temperature_or_tile_is_a_value_error():
    head = Head(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="temperature"):
        token_logps_entropy(torch.zeros(1, 2, 2), head, torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="tile"):
        token_logps_entropy(torch.zeros(1, 2, 2), head, torch.zeros(1, 2, dtype=torch.long), tile=0)


def test_sequences_are_numbered_row_by_row_and_end_on_one_rank():
    # row 0 packed [0 0 0 0 | 1 1 1], row 1 padded at the end; zigzag-like permutation over 2 ranks
    positions = torch.tensor([0, 1, 5, 6, 2, 3, 4])  # layout -> original index
    segments = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0] * 7])
    keep = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
    shard = SeqShard((4, 3), positions, keep[:, positions], segments[:, positions])
    seen_last = torch.zeros(3, dtype=torch.long)
    for rank in range(2):
        batch = LocalBatch(shard, sp_rank=rank, sp_size=2, dp_size=1, denominator=1.0, num_items_in_batch=None,
                           loss_weights=None)
        seqs = sequences(batch, 2, torch.device("cpu"))
        assert seqs.count == 3
        idx = positions[:4] if rank == 0 else positions[4:]
        want = torch.stack([segments[0, idx], torch.where(keep[1, idx], 2, -1)])
        assert torch.equal(seqs.ids, want)
        seen_last.index_add_(0, seqs.ids[seqs.last], torch.ones(int(seqs.last.sum()), dtype=torch.long))
        col = torch.arange(14.0).view(2, 7)  # aligned with the labels: entry i belongs to token i
        shifted = torch.cat([col[:, 1:], torch.zeros(2, 1)], 1)[:, idx]
        assert torch.equal(local_tokens(col, batch, torch.device("cpu")), shifted)
    assert seen_last.tolist() == [1, 1, 1]  # every sequence's last token lives on exactly one rank
