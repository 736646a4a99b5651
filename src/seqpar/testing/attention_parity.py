"""Attention parity cases: a sequence-parallel path against the float64 reference, forward and backward.

Shared by the tests (which assert every case) and ``seqpar verify`` (which prints them). Every rank
builds the same global inputs from the case's seed, runs the reference on the whole sequence,
runs the parallel path on its shard, and reports the largest error of out, dq, dk, dv on its shard
and of d sinks summed over the ranks (each rank's sinks gradient is its own share), and whether the
output is contiguous.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention.dispatch import STRATEGIES
from ..attention.hybrid import hybrid_attention, hybrid_groups
from ..attention.layout import document_cuts, layout_indices
from ..attention.reference import reference_attention
from ..attention.ring import ring_attention
from ..attention.shard import SeqShard
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
    spans: str = "none"  # bidirectional spans: "none" | "images" (runs, one id each) | "prefix" (id 0 on
    # each document's first tokens: PaliGemma's one block, not contiguous on packed rows)
    head_dim: int = 8
    batch: int = 2
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    chunk: int | None = None
    sinks: bool = False  # attention sinks [H] (GPT-OSS), with their gradient
    v_head_dim: int | None = None  # None: head_dim (MLA: another)
    kernel: str = "reference"
    strategy: str = "ulysses"  # "ulysses" | "ring" | "hybrid" -- see ATTENTION_PATHS
    options: dict = field(default_factory=dict, hash=False, compare=False)  # strategy-specific keywords
    seed: int = 0
    dtype: str = "float64"

    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("window", self.window), ("softcap", self.softcap),
                                                     ("scale", self.scale), ("chunk", self.chunk),
                                                     ("Dv", self.v_head_dim)) if v is not None)
        extra += " sinks" if self.sinks else ""
        extra += f" spans={self.spans}" if self.spans != "none" else ""
        opts = "".join(f" {k}={v}" for k, v in self.options.items())
        return (f"{self.strategy}/{self.kernel} S={self.seq} H={self.heads}/{self.kv_heads} "
                f"causal={int(self.causal)} mask={self.mask}{extra}{opts}")


def case_inputs(case: AttnCase) -> dict[str, Tensor | None]:
    """The global inputs of a case, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(case.seed)
    dt = getattr(torch, case.dtype)
    b, s, h, hk, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    dv = case.v_head_dim or d

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)

    out = {"q": rnd(b, s, h, d), "k": rnd(b, s, hk, d), "v": rnd(b, s, hk, dv), "grad": rnd(b, s, h, dv),
           "key_padding_mask": None, "segment_ids": None, "sinks": rnd(h) if case.sinks else None}
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
    out["block_ids"] = case_spans(case, out["segment_ids"], g)
    return out


def case_spans(case: AttnCase, seg: Tensor | None, g: torch.Generator) -> Tensor | None:
    """``[B, S]`` span ids of a case (-1: none), or None: ``"images"`` puts a run over
    ``[S/4, S/2 + 2)`` (it straddles the shard boundaries of P = 2, 3, 4) and up to two more runs
    of random length at random places (one id each), so they straddle shard and document
    boundaries; ``"prefix"`` gives id 0 to the first ~third of every
    document (PaliGemma's prefix block, one id for the row)."""
    b, s = case.batch, case.seq
    if case.spans == "none":
        return None
    blk = torch.full((b, s), -1, dtype=torch.int64)
    if case.spans == "images":
        for row in range(b):
            blk[row, s // 4:s // 2 + 2] = 0
            starts = sorted(torch.randint(0, max(s, 1), (2,), generator=g).tolist())
            for i, a in enumerate(starts, start=1):
                blk[row, a:a + 1 + int(torch.randint(0, max(s // 4, 1), (1,), generator=g))] = i
    elif case.spans == "prefix":
        for row in range(b):
            docs = seg[row] if seg is not None else torch.zeros(s, dtype=torch.int64)
            for d in docs.unique().tolist():
                where = (docs == d).nonzero().flatten()
                blk[row, where[: max(1, where.numel() // 3)]] = 0
    else:
        raise ValueError(f"unknown spans kind {case.spans!r}")
    return blk


# strategy name -> fn(inputs, case, group) -> (inputs, local token index, run)
# A path shards the global inputs itself (layouts differ) and returns the index of the global tokens
# this rank holds and ``run(q, k, v, mask, seg, sinks) -> local out``, so the comparison does not
# depend on the layout.
AttentionPath = Callable[..., tuple[dict, Tensor, Callable]]
ATTENTION_PATHS: dict[str, AttentionPath] = {}


def register_path(name: str) -> Callable[[AttentionPath], AttentionPath]:
    def deco(fn: AttentionPath) -> AttentionPath:
        ATTENTION_PATHS[name] = fn
        return fn
    return deco


def spec_kwargs(case: AttnCase) -> dict:
    """The AttnSpec keywords of a case, as every strategy and the reference take them."""
    return dict(causal=case.causal, scale=case.scale, window=case.window, softcap=case.softcap, chunk=case.chunk)


@register_path("ulysses")
def _ulysses_path(inputs: dict, case: AttnCase, group: dist.ProcessGroup) -> tuple[dict, Tensor, Callable]:
    p, r = dist.get_world_size(group), dist.get_rank(group)
    sizes = split_sizes(case.seq, p)
    start = sum(sizes[:r])
    idx = torch.arange(start, start + sizes[r])

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, seg: Tensor | None, sinks: Tensor | None
            ) -> Tensor:
        return ulysses_attention(q, k, v, group=group, **spec_kwargs(case), sinks=sinks, kernel=case.kernel,
                                 key_padding_mask=mask, segment_ids=seg, **case.options)
    return inputs, idx, run


@register_path("ring")
def _ring_path(inputs: dict, case: AttnCase, group: dist.ProcessGroup) -> tuple[dict, Tensor, Callable]:
    p, r = dist.get_world_size(group), dist.get_rank(group)
    idx = layout_indices(case.seq, p, case.options.get("layout", "contiguous"))[r]

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, seg: Tensor | None, sinks: Tensor | None
            ) -> Tensor:
        return ring_attention(q, k, v, group=group, **spec_kwargs(case), sinks=sinks, kernel=case.kernel,
                              key_padding_mask=mask, segment_ids=seg, **case.options)
    return inputs, idx, run


_HYBRID_GROUPS: dict[tuple[int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def hybrid_case_groups(group: dist.ProcessGroup, ulysses: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``hybrid_groups(group, ulysses)``, built once per process (``new_group`` is collective and slow)."""
    key = (id(group), ulysses)
    if key not in _HYBRID_GROUPS:
        _HYBRID_GROUPS[key] = hybrid_groups(group, ulysses)
    return _HYBRID_GROUPS[key]


@register_path("hybrid")
def _hybrid_path(inputs: dict, case: AttnCase, group: dist.ProcessGroup) -> tuple[dict, Tensor, Callable]:
    p, r = dist.get_world_size(group), dist.get_rank(group)
    opts = dict(case.options)
    ulysses = opts.pop("ulysses", 2 if p % 2 == 0 else 1)
    ulysses_group, ring_group = hybrid_case_groups(group, ulysses)
    idx = layout_indices(case.seq, p, opts.get("layout", "contiguous"), ulysses=ulysses)[r]

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, seg: Tensor | None, sinks: Tensor | None
            ) -> Tensor:
        return hybrid_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group, **spec_kwargs(case),
                                sinks=sinks, kernel=case.kernel, key_padding_mask=mask, segment_ids=seg, **opts)
    return inputs, idx, run


def shard_path(strategy: str, layout: str | None = None) -> AttentionPath:
    """``strategy``'s path with the global masks (padding, documents, span ids) in a SeqShard, as
    shard_batch builds it, on ``layout`` (None: the case's ``layout`` option, else contiguous);
    ``"doc-zigzag"`` follows the case's documents and padding."""
    base = ATTENTION_PATHS[strategy]

    def path(inputs: dict, case: AttnCase, group: dist.ProcessGroup) -> tuple[dict, Tensor, Callable]:
        p, r = dist.get_world_size(group), dist.get_rank(group)
        keep, seg, blk = inputs["key_padding_mask"], inputs["segment_ids"], inputs.get("block_ids")
        opts = dict(case.options)
        how = layout or opts.pop("layout", "contiguous")
        ulysses = opts.get("ulysses", (2 if p % 2 == 0 else 1) if strategy == "hybrid" else 1)
        cuts = document_cuts(seg, keep) if how == "doc-zigzag" else None
        parts = layout_indices(case.seq, p, how, ulysses, cuts)
        perm = torch.cat(parts)

        def permuted(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[:, perm]

        shard = SeqShard(tuple(len(t) for t in parts), None if how == "contiguous" else perm, permuted(keep),
                         permuted(seg), blocks=permuted(blk))
        _, _, run = base(inputs, replace(case, strategy=strategy, options={**opts, "shard": shard}), group)
        return inputs, parts[r], lambda q, k, v, mask, seg_ids, sinks: run(q, k, v, None, None, sinks)
    return path


for _name in STRATEGIES:
    register_path(f"{_name}:doc-zigzag")(shard_path(_name, "doc-zigzag"))


def doc_zigzag_cases(strategy: str, quick: bool = False) -> list[AttnCase]:
    """``strategy`` on the doc-zigzag layout (each document and padding run zigzagged over the
    ring): odd lengths, every mask, the fused CPU kernel with both ring comms, window, softcap,
    sinks and chunk."""
    name = f"{strategy}:doc-zigzag"
    comms = [{}] if strategy == "ulysses" else [{"comm": "p2p"}, {"comm": "allgather"}]
    cases = [AttnCase(seq=s, heads=6, kv_heads=1, causal=c, mask=m, strategy=name)
             for s in ((37,) if quick else (7, 37, 129)) for c in (False, True) for m in ("none", "pad", "packed")]
    cases += [AttnCase(seq=129, heads=8, kv_heads=2, causal=True, mask=m, kernel="flash_cpu" if strategy != "ulysses"
                       else "auto", strategy=name, options=o) for m in ("pad", "packed") for o in comms]
    cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, mask="packed", window=5,
                       kernel="flash_cpu" if strategy != "ulysses" else "auto", strategy=name),
              AttnCase(seq=37, heads=8, kv_heads=2, causal=True, mask="pad", softcap=2.0, scale=0.3, chunk=8,
                       sinks=True, strategy=name, kernel="tiled")]
    return cases


def feature_cases(strategy: str, quick: bool = False) -> list[AttnCase]:
    """Attention sinks, chunked attention (with window) and a v head dim other than q's and k's
    (MLA: D=8 with Dv=5 or 12), on odd lengths, GQA with fewer KV heads than ranks and padded /
    packed rows, with every kernel that can honour them (sdpa_dense has no sinks); ring and hybrid with
    the zigzag layout, and with K/V gathered once (reference kernel: the comm is kernel-blind)."""
    kernels = ("reference", "auto", "sdpa_dense") if strategy == "ulysses" else ("reference", "flash_cpu")
    variants = [{}] if strategy == "ulysses" else [{"layout": "zigzag"}, {"comm": "allgather"}]
    cases = []
    for kernel in kernels[:1] if quick else kernels:
        for opts in variants[:1] if quick or kernel != "reference" else variants:
            kw = dict(strategy=strategy, kernel=kernel, options=opts)
            cases += [AttnCase(seq=37, heads=6, kv_heads=1, causal=True, chunk=8, mask="pad", **kw),
                      AttnCase(seq=7, heads=8, kv_heads=2, chunk=3, mask="packed", **kw),
                      AttnCase(seq=37, heads=8, kv_heads=2, causal=True, chunk=8, window=5, **kw),
                      AttnCase(seq=37, heads=6, kv_heads=1, causal=True, v_head_dim=5, mask="packed", **kw),
                      AttnCase(seq=7, heads=8, kv_heads=2, v_head_dim=12, mask="pad", **kw)]
            if kernel != "sdpa_dense":  # left-padded causal rows see no key: only the sink
                cases += [AttnCase(seq=37, heads=6, kv_heads=1, causal=True, sinks=True, mask="pad", **kw),
                          AttnCase(seq=7, heads=8, kv_heads=2, sinks=True, mask="packed", **kw),
                          AttnCase(seq=37, heads=8, kv_heads=2, causal=True, sinks=True, chunk=8, window=5,
                                   v_head_dim=12, mask="packed", **kw)]
    # sinks with softcap (reference and tiled), and with fewer query heads than ranks (idle ranks)
    cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, sinks=True, softcap=2.0, scale=0.3, chunk=16,
                       mask=m, strategy=strategy, kernel=k) for k, m in (("reference", "pad"), ("tiled", "packed"))]
    cases += [
              AttnCase(seq=7, heads=3, kv_heads=1, causal=True, sinks=True, mask="pad", strategy=strategy)]
    return cases


def attention_grid(strategy: str, quick: bool) -> list[AttnCase]:
    """The cases ``seqpar verify`` (and the attention test suites) run for one strategy, the
    :func:`feature_cases` included."""
    lengths = (7, 129) if quick else (1, 7, 37, 129)
    heads = ((8, 2), (6, 1)) if quick else ((8, 8), (8, 2), (8, 1), (6, 3), (6, 1), (12, 4))
    cases = [AttnCase(seq=s, heads=h, kv_heads=hk, causal=c, mask=m, strategy=strategy)
             for s in lengths for h, hk in heads for c in (False, True) for m in ("none", "pad", "packed")]
    cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, window=5, softcap=3.0, scale=0.3, mask="pad",
                       strategy=strategy)]
    if strategy == "ulysses":
        cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, kernel=k, mask=m, strategy=strategy)
                  for k in ("flash_cpu", "tiled", "sdpa_dense") for m in ("pad", "packed")]
    if strategy in ("ring", "hybrid"):  # the load-balanced layout, the fused CPU kernel, K/V gathered once
        cases += [AttnCase(seq=c.seq, heads=c.heads, kv_heads=c.kv_heads, causal=True, mask=c.mask, strategy=strategy,
                           options={"layout": "zigzag"}) for c in cases if c.causal and c.window is None]
        cases += [AttnCase(seq=37, heads=8, kv_heads=2, causal=True, kernel="flash_cpu", mask=m, window=w,
                           strategy=strategy, options={"layout": "zigzag", "comm": comm})
                  for m in ("pad", "packed") for w in (None, 5) for comm in ("p2p", "allgather")]
    return cases + feature_cases(strategy, quick) + doc_zigzag_cases(strategy, quick)


def run_case(case: AttnCase, group: dist.ProcessGroup) -> dict[str, float]:
    """Run one case on this rank; returns max |err| of out, dq, dk, dv over this rank's tokens, of
    d sinks (summed over the ranks) and ``contiguous`` (1.0 when the output is)."""
    inputs = case_inputs(case)
    q, k, v, grad, sinks = (inputs[n] for n in ("q", "k", "v", "grad", "sinks"))
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_sinks = None if sinks is None else sinks.clone().requires_grad_(True)
    ref_out, _ = reference_attention(*ref_in, **spec_kwargs(case), sinks=ref_sinks,
                                     key_padding_mask=inputs["key_padding_mask"], segment_ids=inputs["segment_ids"],
                                     block_ids=inputs["block_ids"])
    ref_out.backward(grad)

    path = ATTENTION_PATHS[case.strategy]
    if case.spans != "none" and ":" not in case.strategy:  # span ids travel in the batch's SeqShard
        path = shard_path(case.strategy)
    _, idx, run = path(inputs, case, group)
    local = [t[:, idx].clone().requires_grad_(True) for t in (q, k, v)]
    local_sinks = None if sinks is None else sinks.clone().requires_grad_(True)
    mask = inputs["key_padding_mask"][:, idx] if inputs["key_padding_mask"] is not None else None
    seg = inputs["segment_ids"][:, idx] if inputs["segment_ids"] is not None else None
    out = run(*local, mask, seg, local_sinks)
    out.backward(grad[:, idx])

    def err(a: Tensor, b: Tensor) -> float:
        return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0

    errs = {"out": err(out, ref_out[:, idx]),
            "dq": err(local[0].grad, ref_in[0].grad[:, idx]),
            "dk": err(local[1].grad, ref_in[1].grad[:, idx]),
            "dv": err(local[2].grad, ref_in[2].grad[:, idx]),
            "dsinks": 0.0, "contiguous": float(out.is_contiguous())}
    if local_sinks is not None:
        if local_sinks.grad is None:  # a rank must give its (possibly zero) share
            errs["dsinks"] = float("inf")
        dsinks = local_sinks.grad if local_sinks.grad is not None else torch.zeros_like(local_sinks)
        dsinks = dsinks.detach().clone()
        dist.all_reduce(dsinks, group=group)  # each rank's gradient is its share: the sum is the total
        errs["dsinks"] = max(errs["dsinks"], err(dsinks, ref_sinks.grad))
    return errs


ERRORS = ("out", "dq", "dk", "dv", "dsinks")


def run_cases(rank: int, world: int, cases: list[AttnCase]) -> list[dict]:
    """Worker entry: every case on the default group; errors reduced to the max over ranks and
    ``contiguous`` to the min (1.0: every rank's output was contiguous)."""
    group = dist.group.WORLD
    rows = []
    for case in cases:
        errs = run_case(case, group)
        t = torch.tensor([errs[n] for n in ERRORS] + [-errs["contiguous"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        rows.append({"case": asdict(case), "label": case.label(), "P": world,
                     **dict(zip(ERRORS, t.tolist(), strict=False)), "contiguous": -float(t[-1])})
    return rows


def bad_rows(rows: list[dict], tol: float) -> list[tuple[str, dict]]:
    """The rows past ``tol`` in any error, or whose output was not contiguous, with their errors."""
    return [(r["label"], {n: r[n] for n in (*ERRORS, "contiguous")}) for r in rows
            if not (max(r[n] for n in ERRORS) <= tol and r["contiguous"] == 1.0)]


def run_rest(cases: list[AttnCase], p: int, tol: float) -> None:
    """The part of a grid ``make verify`` runs alone (:func:`~seqpar.testing.sampling.covering_sample`'s
    rest) at ``p`` ranks, one spawn: every case ran, in order, and within ``tol``."""
    from ..comm.launch import run_distributed

    rows = run_distributed(run_cases, p, cases, timeout=900)[0]
    assert [r["label"] for r in rows] == [c.label() for c in cases]
    bad = bad_rows(rows, tol)
    assert not bad, f"P={p}: {len(bad)} case(s) past {tol}: {bad[:5]}"
