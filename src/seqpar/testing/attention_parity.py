"""Attention parity cases: a sequence-parallel path against the float64 reference, forward and backward.

Shared by the tests (which assert every case) and ``seqpar verify`` (which prints them). Every rank
builds the same global inputs from the case's seed, runs the reference on the whole sequence,
runs the parallel path on its shard, and reports the largest error of out, dq, dk, dv on its shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention.hybrid import hybrid_attention, hybrid_groups
from ..attention.layout import layout_indices
from ..attention.reference import reference_attention
from ..attention.ring import ring_attention
from ..attention.ulysses import ulysses_attention
from ..comm.collectives import split_sizes


@dataclass(frozen=True)
class AttnCase:
    """One parity case; the world size is the number of processes it runs on."""

    seq: int
    heads: int
    kv_heads: int
    causal: bool = False
    mask: str = "none"  # "none" | "pad" (row 0 right-padded, row 1 left-padded) | "packed"
    head_dim: int = 8
    batch: int = 2
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    kernel: str = "reference"
    strategy: str = "ulysses"  # "ulysses" | "ring" | "hybrid" -- see ATTENTION_PATHS
    options: dict = field(default_factory=dict, hash=False, compare=False)  # strategy-specific keywords
    seed: int = 0
    dtype: str = "float64"

    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("window", self.window), ("softcap", self.softcap),
                                                     ("scale", self.scale)) if v is not None)
        opts = "".join(f" {k}={v}" for k, v in self.options.items())
        return (f"{self.strategy}/{self.kernel} S={self.seq} H={self.heads}/{self.kv_heads} "
                f"causal={int(self.causal)} mask={self.mask}{extra}{opts}")


def case_inputs(case: AttnCase) -> dict[str, Tensor | None]:
    """The global inputs of a case, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(case.seed)
    dt = getattr(torch, case.dtype)
    b, s, h, hk, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)

    out = {"q": rnd(b, s, h, d), "k": rnd(b, s, hk, d), "v": rnd(b, s, hk, d), "grad": rnd(b, s, h, d),
           "key_padding_mask": None, "segment_ids": None}
    if case.mask == "pad":
        keep = torch.ones(b, s, dtype=torch.bool)
        for row in range(b):
            n_real = max(1, s - 1 - (row * 3 + s // 3) % max(s, 1))
            if row % 2 == 0:
                keep[row, n_real:] = False  # right padding
            else:
                keep[row, : s - n_real] = False  # left padding: causal rows that see nothing
        out["key_padding_mask"] = keep
    elif case.mask == "packed":
        seg = torch.zeros(b, s, dtype=torch.int64)
        for row in range(b):
            cuts = sorted(torch.randint(1, max(s, 2), (3,), generator=g).tolist())
            for c in cuts:
                seg[row, c:] += 1
        out["segment_ids"] = seg
    elif case.mask != "none":
        raise ValueError(f"unknown mask kind {case.mask!r}")
    return out


# strategy name -> fn(q, k, v, *, group, case, key_padding_mask, segment_ids) -> (local out, local slices)
# A path shards the global inputs itself (layouts differ), runs, and returns its local output and the
# index of the global tokens it holds, so the comparison does not depend on the layout.
AttentionPath = Callable[..., tuple[Tensor, Tensor]]
ATTENTION_PATHS: dict[str, AttentionPath] = {}


def register_path(name: str) -> Callable[[AttentionPath], AttentionPath]:
    def deco(fn: AttentionPath) -> AttentionPath:
        ATTENTION_PATHS[name] = fn
        return fn
    return deco


@register_path("ulysses")
def _ulysses_path(inputs: dict, case: AttnCase, group: dist.ProcessGroup) -> tuple[dict, Tensor, Callable]:
    p, r = dist.get_world_size(group), dist.get_rank(group)
    sizes = split_sizes(case.seq, p)
    start = sum(sizes[:r])
    idx = torch.arange(start, start + sizes[r])

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, seg: Tensor | None) -> Tensor:
        return ulysses_attention(q, k, v, group=group, causal=case.causal, scale=case.scale, window=case.window,
                                 softcap=case.softcap, kernel=case.kernel, key_padding_mask=mask,
                                 segment_ids=seg, **case.options)
    return inputs, idx, run


@register_path("ring")
def _ring_path(inputs: dict, case: AttnCase, group: dist.ProcessGroup) -> tuple[dict, Tensor, Callable]:
    p, r = dist.get_world_size(group), dist.get_rank(group)
    idx = layout_indices(case.seq, p, case.options.get("layout", "contiguous"))[r]

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, seg: Tensor | None) -> Tensor:
        return ring_attention(q, k, v, group=group, causal=case.causal, scale=case.scale, window=case.window,
                              softcap=case.softcap, kernel=case.kernel, key_padding_mask=mask,
                              segment_ids=seg, **case.options)
    return inputs, idx, run


_HYBRID_GROUPS: dict[tuple[int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


@register_path("hybrid")
def _hybrid_path(inputs: dict, case: AttnCase, group: dist.ProcessGroup) -> tuple[dict, Tensor, Callable]:
    p, r = dist.get_world_size(group), dist.get_rank(group)
    opts = dict(case.options)
    ulysses = opts.pop("ulysses", 2 if p % 2 == 0 else 1)
    key = (id(group), ulysses)
    if key not in _HYBRID_GROUPS:  # new_group is collective and slow: once per (group, ulysses) per process
        _HYBRID_GROUPS[key] = hybrid_groups(group, ulysses)
    ulysses_group, ring_group = _HYBRID_GROUPS[key]
    idx = layout_indices(case.seq, p, opts.get("layout", "contiguous"), ulysses=ulysses)[r]

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, seg: Tensor | None) -> Tensor:
        return hybrid_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group, causal=case.causal,
                                scale=case.scale, window=case.window, softcap=case.softcap, kernel=case.kernel,
                                key_padding_mask=mask, segment_ids=seg, **opts)
    return inputs, idx, run


def attention_grid(strategy: str, quick: bool) -> list[AttnCase]:
    """The cases ``seqpar verify`` (and the attention test suites) run for one strategy."""
    lengths = (7, 129) if quick else (1, 7, 37, 129)
    heads = ((8, 2), (6, 1)) if quick else ((8, 8), (8, 2), (8, 1), (6, 3), (6, 1), (12, 4))
    cases = [AttnCase(seq=s, heads=h, kv_heads=hk, causal=c, mask=m, strategy=strategy)
             for s in lengths for h, hk in heads for c in (False, True) for m in ("none", "pad", "packed")]
    cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, window=5, softcap=3.0, scale=0.3, mask="pad",
                       strategy=strategy)]
    if strategy == "ulysses":
        cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, kernel=k, mask=m, strategy=strategy)
                  for k in ("flash_cpu", "sdpa") for m in ("pad", "packed")]
    if strategy in ("ring", "hybrid"):  # the load-balanced layout, the fused CPU kernel, K/V gathered once
        cases += [AttnCase(seq=c.seq, heads=c.heads, kv_heads=c.kv_heads, causal=True, mask=c.mask, strategy=strategy,
                           options={"layout": "zigzag"}) for c in cases if c.causal and c.window is None]
        cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, kernel="flash_cpu", mask=m, window=w,
                           strategy=strategy, options={"layout": "zigzag", "comm": comm})
                  for m in ("pad", "packed") for w in (None, 5) for comm in ("p2p", "allgather")]
    return cases


def run_case(case: AttnCase, group: dist.ProcessGroup) -> dict[str, float]:
    """Run one case on this rank; returns max |err| of out, dq, dk, dv over this rank's tokens."""
    inputs = case_inputs(case)
    q, k, v, grad = (inputs[n] for n in ("q", "k", "v", "grad"))
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_in, causal=case.causal, scale=case.scale, window=case.window,
                                     softcap=case.softcap, key_padding_mask=inputs["key_padding_mask"],
                                     segment_ids=inputs["segment_ids"])
    ref_out.backward(grad)

    _, idx, run = ATTENTION_PATHS[case.strategy](inputs, case, group)
    local = [t[:, idx].clone().requires_grad_(True) for t in (q, k, v)]
    mask = inputs["key_padding_mask"][:, idx] if inputs["key_padding_mask"] is not None else None
    seg = inputs["segment_ids"][:, idx] if inputs["segment_ids"] is not None else None
    out = run(*local, mask, seg)
    out.backward(grad[:, idx])

    def err(a: Tensor, b: Tensor) -> float:
        return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0

    return {"out": err(out, ref_out[:, idx]),
            "dq": err(local[0].grad, ref_in[0].grad[:, idx]),
            "dk": err(local[1].grad, ref_in[1].grad[:, idx]),
            "dv": err(local[2].grad, ref_in[2].grad[:, idx])}


def run_cases(rank: int, world: int, cases: list[AttnCase]) -> list[dict]:
    """Worker entry: every case on the default group; errors reduced to the max over ranks."""
    group = dist.group.WORLD
    rows = []
    for case in cases:
        errs = run_case(case, group)
        t = torch.tensor([errs[n] for n in ("out", "dq", "dk", "dv")], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        rows.append({"case": asdict(case), "label": case.label(), "P": world,
                     **dict(zip(("out", "dq", "dk", "dv"), t.tolist(), strict=True))})
    return rows
