"""``kernel="flex"`` inside Ulysses, ring (zigzag and doc-zigzag) and hybrid on gloo processes,
P = 1..4, odd lengths, GQA with fewer KV heads than ranks, padded and packed rows, window and
softcap: the forward against the float64 reference. The forward only: torch has no CPU backward
for flex (its backward's merge math is checked in test_lse_kernels; the compiled CUDA kernel by
the gpu-marked tests). Out to 1e-8, not 1e-10: torch's uncompiled flex now and then returns one
row's lse 1.5e-9 off on its first call in a process, and a ring merges blocks by their lse. With
autograd on, the missing backward is a ValueError on every rank. P = 1 and 3 run in make verify."""

import warnings

import pytest
import torch
import torch.distributed as dist

from seqpar.attention.reference import reference_attention
from seqpar.attention.ulysses import ulysses_attention
from seqpar.comm.launch import run_distributed
from seqpar.testing.attention_parity import ATTENTION_PATHS, AttnCase, case_inputs, spec_kwargs

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes

TOL = 1e-8


def _cases(world: int) -> list[AttnCase]:
    cases = [AttnCase(seq=s, heads=8, kv_heads=2, causal=True, mask=m, kernel="flex", strategy=st, options=o)
             for s in (37, 129) for m in ("pad", "packed")
             for st, o in (("ulysses", {}), ("ring", {"layout": "zigzag"}), ("ring:doc-zigzag", {}))]
    cases += [AttnCase(seq=37, heads=6, kv_heads=1, causal=True, window=5, softcap=2.0, mask="packed", kernel="flex",
                       strategy="ring", options={"layout": "zigzag"}),
              AttnCase(seq=37, heads=6, kv_heads=1, softcap=3.0, mask="pad", kernel="flex", strategy="ulysses")]
    if world == 4:
        cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, mask=m, kernel="flex", strategy="hybrid",
                           options={"ulysses": 2, "layout": "zigzag"}) for m in ("pad", "packed")]
    return cases


def _worker(rank: int, world: int) -> dict:
    warnings.filterwarnings("ignore", message="kernel='flex' on cpu")
    group = dist.group.WORLD
    errors = {}
    for case in _cases(world):
        inputs = case_inputs(case)
        q, k, v = (inputs[n] for n in ("q", "k", "v"))
        want, _ = reference_attention(q, k, v, **spec_kwargs(case), key_padding_mask=inputs["key_padding_mask"],
                                      segment_ids=inputs["segment_ids"])
        _, idx, run = ATTENTION_PATHS[case.strategy](inputs, case, group)
        mask = None if inputs["key_padding_mask"] is None else inputs["key_padding_mask"][:, idx]
        seg = None if inputs["segment_ids"] is None else inputs["segment_ids"][:, idx]
        with torch.no_grad():
            out = run(q[:, idx], k[:, idx], v[:, idx], mask, seg, None)
        err = torch.tensor([float((out - want[:, idx]).abs().max()) if out.numel() else 0.0], dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        errors[case.label()] = float(err)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(2, 5, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    try:
        ulysses_attention(q, k, v, group=group, causal=True, kernel="flex").sum().backward()
        raised = None
    except ValueError as e:
        raised = str(e)
    return {"errors": errors, "raised": raised}


# make test: P = 2 (uneven shards already: 37 and 129 tokens over 2) and P = 4 (the deepest ring, and
# hybrid); P = 1 (no exchange) and P = 3 in make verify -- uncompiled flex on the CPU makes each P
# 10-35 s here (make test's load), and both repeat what P = 2 and 4 check
@pytest.fixture(scope="module", params=[pytest.param(1, marks=pytest.mark.heavy), 2,
                                        pytest.param(3, marks=pytest.mark.heavy), 4], ids=lambda p: f"P{p}")
def seen(request):
    return request.param, run_distributed(_worker, request.param, timeout=600)


def test_flex_in_every_strategy_matches_the_reference(seen):
    p, per_rank = seen
    errors = per_rank[0]["errors"]
    assert len(errors) == len(_cases(p))
    bad = {label: e for label, e in errors.items() if not e <= TOL}
    assert not bad, f"P={p}: {bad}"


def test_flex_backward_on_cpu_is_a_value_error_on_every_rank(seen):
    p, per_rank = seen
    for rank, r in enumerate(per_rank):
        assert r["raised"] is not None and "kernel='flex' has no backward on cpu" in r["raised"], (rank, r["raised"])
