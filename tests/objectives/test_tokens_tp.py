"""The objectives' per-token log-probabilities and entropy with a vocabulary-parallel head (tensor
parallelism): on 3 gloo ranks, each holding ``torch.chunk``'s rows of the head (uneven: 11 rows as
4 + 4 + 3, 7 as 3 + 3 + 1, 2 as 1 + 1 + 0 -- a rank with no row), the values on every rank and the
gradients of the hidden states and of each rank's rows equal the whole head's (float64), with a
temperature, a softcap, scaled logits, ignored targets and tiles that do not divide the tokens."""

import pytest
import torch
import torch.distributed as dist

from seqpar.batch.tiled_loss import Head
from seqpar.batch.vocab_parallel import vocab_range
from seqpar.comm.launch import run_distributed
from seqpar.objectives import token_logps_entropy

CASES = [(11, 4, "plain"), (7, 3, "softcap"), (2, 5, "scaled"), (11, 1024, "softcap")]  # (vocab, tile, head)


def _one(rank: int, world: int, vocab: int, tile: int, kind: str) -> dict[str, float]:
    g = torch.Generator().manual_seed(vocab * 100 + tile)  # the same draws on every rank
    hidden = torch.randn(2, 9, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, 6, generator=g, dtype=torch.float64)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (2, 9), generator=g)
    targets[0, :3] = -100
    a, b = torch.rand(2, 9, generator=g, dtype=torch.float64), torch.rand(2, 9, generator=g, dtype=torch.float64)
    kw = {"softcap": {"softcap": 3.0}, "scaled": {"scale": 0.7, "divide": 1.3}}.get(kind, {})

    def run(w, bi, **head_kw):
        h = hidden.clone().requires_grad_(True)
        w, bi = w.clone().requires_grad_(True), bi.clone().requires_grad_(True)
        logp, ent = token_logps_entropy(h, Head(w, bi, **kw, **head_kw), targets, temperature=0.7, tile=tile)
        ((logp * a).sum() + (ent * b).sum()).backward()
        return logp.detach(), ent.detach(), h.grad, w.grad, bi.grad

    whole = run(weight, bias)
    start, end = vocab_range(vocab, world, rank)
    mine = run(weight[start:end], bias[start:end], tp_group=dist.group.WORLD, vocab_start=start)
    diff = {name: float((x - y).abs().max()) if x.numel() else 0.0
            for name, x, y in zip(("logp", "entropy", "grad_hidden"), mine[:3], whole[:3], strict=True)}
    diff["grad_weight"] = float((mine[3] - whole[3][start:end]).abs().max()) if end > start else 0.0
    diff["grad_bias"] = float((mine[4] - whole[4][start:end]).abs().max()) if end > start else 0.0
    diff["scale"] = float(whole[2].abs().max())  # not trivially zero
    return diff


def _all(rank: int, world: int) -> list[dict[str, float]]:
    return [_one(rank, world, *case) for case in CASES]


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all, 3, timeout=120)


@pytest.mark.distributed
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"V{v}-tile{t}-{k}" for v, t, k in CASES])
def test_vocabulary_parallel_logps_and_entropy_equal_the_whole_heads(results, case):
    for rank, per_rank in enumerate(results):
        d = per_rank[case]
        assert d["scale"] > 1e-3, d
        assert d["logp"] < 1e-13 and d["entropy"] < 1e-13, (rank, d)
        assert d["grad_hidden"] < 1e-12 and d["grad_weight"] < 1e-12 and d["grad_bias"] < 1e-12, (rank, d)
