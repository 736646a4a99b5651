"""Seeded fuzz of what users hand seqpar: ``sp_attention`` and ``shard_batch`` + ``parallelize``.

Each case is drawn from its seed alone (:func:`draw`), the same on every rank: a target, shapes (odd
lengths, S < P, batch sizes), GQA head counts (fewer KV heads than ranks, heads no rank count
divides), dtypes, masks (right / left padding, an all-padding row, packed documents by position ids
or by ``cu_seq_lens``), labels (-100 everywhere, a wrong shape) and, on one rank only, a
*disagreement* (another dtype, shape, mask, option or batch). Every rank runs it and reports an
:class:`Outcome`; the verdict (:func:`problems`) holds each case to the product's promise:

    exact       the result equals the unsharded float64 reference (attention: out and dq/dk/dv;
                a model: loss and every gradient, :mod:`seqpar.testing.model_parity`'s tolerances)
    ValueError  raised on EVERY rank (seqpar's agreement path), before any collective could hang

and anything else -- a rank timing out (a hang), another exception type, a wrong result, ranks that
disagree on the outcome, a disagreement that ran through silently -- is a failure naming its seed, so
``python benchmarks/bench_fuzz.py --seed S --cases 1`` replays it. A case stops its worker's loop
when it leaves the process group unusable (a timeout).
"""

from __future__ import annotations

import copy
import json
import os
import random
import tempfile
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..attention.dispatch import sp_attention
from ..attention.layout import layout_indices
from ..attention.reference import reference_attention
from ..comm.launch import WorkerError, run_distributed
from ..comm.mesh import init_mesh
from .fuzz_model import fuzz_batch, fuzz_reference
from .model_parity import ModelCase, compare_models, make_model, precision_floor

ATTN_ODD = ("dtype", "heads", "head_dim", "batch", "mask-given", "mask-shape", "causal", "window", "strategy",
            "seq-k", "layout")
# not drawn: ranks that parallelize the model with different strategies (a known limit, not checked: the
# model's attention runs validate=False on shard_batch's agreement, which does not know the model)
MODEL_ODD = ("ids", "seq", "layout", "mask-given", "items", "labels")
ATTN_TOL = 1e-10  # float64 against float64: rounding only (as tests/attention)
F32_ULPS = 8  # float32: twice the unsharded float32 reference's error plus 8 ulp (tests/attention/test_lse_kernels)


@dataclass(frozen=True)
class FuzzCase:
    """One drawn case (:func:`draw`); ``odd`` names what ``odd_rank`` alone gets different."""

    seed: int
    world: int
    target: str  # "attention" | "model"
    strategy: str
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    window: int | None
    mask: str  # none | right | left | empty-row | packed | packed-pad | cu_seqlens
    dtype: str
    layout: str
    labels: str  # ok | ignored | short (model cases)
    odd: str | None
    odd_rank: int

    def label(self) -> str:
        odd = f" odd={self.odd}@{self.odd_rank}" if self.odd else ""
        extra = f" window={self.window}" if self.window else ""
        labels = f" labels={self.labels}" if self.target == "model" else ""
        return (f"seed={self.seed} P={self.world} {self.target} {self.strategy}/{self.layout} B={self.batch} "
                f"S={self.seq} H={self.heads}/{self.kv_heads} D={self.head_dim} {self.dtype} causal={int(self.causal)}"
                f"{extra} mask={self.mask}{labels}{odd}")

    @property
    def invalid(self) -> str | None:
        """What makes the case bad input as a whole (a ValueError is then required), or None."""
        if self.odd:
            return f"odd {self.odd}"
        if self.labels == "short":
            return "labels shape"
        return None


def draw(seed: int, world: int) -> FuzzCase:
    """The case of ``seed`` on ``world`` ranks: pure, the same on every rank."""
    rng = random.Random(seed * 1_000_003 + world)
    target = rng.choice(("attention", "attention", "model"))
    strategies = ["ulysses", "ring"] + (["hybrid"] if world == 4 else [])
    strategy = rng.choice(strategies)
    seq = rng.choice((1, world - 1 or 1, world, world + 1, 7, 13, 2 * world + 1, 24, 37))
    heads = rng.choice((1, 2, 3, 4, 6, 8))
    kv_heads = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    causal = target == "model" or rng.random() < 0.6
    window = rng.choice((None, None, 3)) if target == "attention" and causal else None
    if target == "attention":
        mask = rng.choice(("none", "right", "left", "empty-row", "packed", "packed-pad"))
        dtype = rng.choice(("float64", "float64", "float32"))
        layout = rng.choice(("contiguous", "zigzag"))
        labels, head_dim = "ok", rng.choice((4, 8))
    else:
        mask = rng.choice(("none", "right", "left", "empty-row", "packed", "cu_seqlens"))
        dtype, layout, head_dim = "float64", rng.choice(("contiguous", "zigzag", "doc-zigzag")), 8
        labels = rng.choice(("ok", "ok", "ok", "ignored", "short"))
    odd = rng.choice(ATTN_ODD if target == "attention" else MODEL_ODD) if rng.random() < 0.35 else None
    return FuzzCase(seed, world, target, strategy, rng.choice((1, 2, 3)), seq, heads, kv_heads, head_dim, causal,
                    window, mask, dtype, layout, labels, odd, rng.randrange(world))


@dataclass(frozen=True)
class Outcome:
    """One rank's end of a case: ``kind`` "exact", "inexact", "ValueError" or another exception's
    type name ("timeout" when the process group timed out); ``detail``: the error or message."""

    kind: str
    detail: str = ""


# --------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------

def attention_masks(case: FuzzCase, g: torch.Generator) -> tuple[Tensor | None, Tensor | None]:
    """``(key_padding_mask [B, S] bool, segment_ids [B, S] long)`` of a case, global."""
    b, s = case.batch, case.seq
    keep = seg = None
    if case.mask in ("right", "left", "empty-row", "packed-pad"):
        keep = torch.ones(b, s, dtype=torch.bool)
        for row in range(b):
            n = int(torch.randint(0, s + 1, (1,), generator=g))  # padded tokens (0..S: a whole row too)
            if case.mask == "empty-row" and row == 0:
                n = s
            if case.mask == "left" or (case.mask != "right" and row % 2):
                keep[row, :n] = False
            else:
                keep[row, s - n:] = False
    if case.mask in ("packed", "packed-pad"):
        seg = (torch.rand(b, s, generator=g) < 0.25).long().cumsum(-1)  # a new document at ~1 token in 4
    return keep, seg


def _err(a: Tensor, b: Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def run_attention(case: FuzzCase, meshes: dict[str, DeviceMesh]) -> Outcome:
    """``sp_attention`` on this rank's shard against the float64 reference on the whole batch."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(case.seed)
    b, s, h, hk, d = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
    q, k, v, grad = (torch.randn(b, s, n, d, generator=g, dtype=torch.float64) for n in (h, hk, hk, h))
    keep, seg = attention_masks(case, g)
    spec = dict(causal=case.causal, window=case.window)
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_in, **spec, key_padding_mask=keep, segment_ids=seg)
    ref_out.backward(grad)
    dt = getattr(torch, case.dtype)
    floor = [0.0] * 4
    if dt != torch.float64:  # the unsharded reference in that dtype: the precision the dtype allows
        low = [t.to(dt).requires_grad_(True) for t in (q, k, v)]
        low_out, _ = reference_attention(*low, **spec, key_padding_mask=keep, segment_ids=seg)
        low_out.backward(grad.to(dt))
        floor = [2 * _err(x, y) + F32_ULPS * torch.finfo(dt).eps * float(y.detach().abs().max())
                 for x, y in zip((low_out, *(t.grad for t in low)), (ref_out, *(t.grad for t in ref_in)), strict=True)]

    strategy, layout = case.strategy, case.layout
    odd = case.odd if rank == case.odd_rank else None
    if odd == "strategy":
        strategy = "ring" if strategy != "ring" else "ulysses"
    if odd == "layout":
        layout = "zigzag" if layout == "contiguous" else "contiguous"
    mesh = meshes["hybrid" if strategy == "hybrid" else "flat"]
    ulysses = 2 if strategy == "hybrid" else 1
    idx = layout_indices(s, case.world, layout, ulysses)[rank]
    local = [t[:, idx].to(dt) for t in (q, k, v)]
    opts: dict = {**spec, "kernel": "reference", "key_padding_mask": None if keep is None else keep[:, idx],
                  "segment_ids": None if seg is None else seg[:, idx], "layout": layout}
    if odd == "dtype":
        local = [t.to(torch.float32 if dt == torch.float64 else torch.float64) for t in local]
    elif odd in ("heads", "head_dim", "batch", "seq-k"):
        shape = {"heads": (b, len(idx), h + hk, d), "head_dim": (b, len(idx), h, d + 2),
                 "batch": (b + 1, len(idx), h, d)}.get(odd)
        if shape is not None:
            local[0] = torch.randn(*shape, dtype=dt)
            if odd != "heads":
                local[1:] = [torch.randn(*shape[:2], hk, shape[3], dtype=dt) for _ in range(2)]
        else:
            local[1] = local[1][:, : max(len(idx) - 1, 0)]
    elif odd == "mask-given":
        opts["key_padding_mask"] = None if keep is not None else torch.ones(b, len(idx), dtype=torch.bool)
    elif odd == "mask-shape":
        opts["key_padding_mask"] = torch.ones(b, len(idx) + 1, dtype=torch.bool)
    elif odd == "causal":
        opts["causal"] = not case.causal
    elif odd == "window":
        opts["window"] = 2 if case.window is None else None
    local = [t.requires_grad_(True) for t in local]
    out = sp_attention(*local, mesh=mesh, strategy=strategy, **opts)
    out.backward(grad[:, idx].to(out.dtype) if out.shape == grad[:, idx].shape else torch.ones_like(out))
    if odd is not None:  # a disagreement that ran through: wrong by construction, whatever the numbers
        return Outcome("inexact", f"rank {rank} ran with odd {odd}")
    errs = [_err(x, y[:, idx]) for x, y in zip((out, *(t.grad for t in local)), (ref_out, *(t.grad for t in ref_in)),
                                                strict=True)]
    bounds = [ATTN_TOL if dt == torch.float64 else f for f in floor]
    bad = [f"{n} {e:.3g} > {t:.3g}" for n, e, t in zip(("out", "dq", "dk", "dv"), errs, bounds, strict=True) if e > t]
    return Outcome("inexact", "; ".join(bad)) if bad else Outcome("exact", f"max err {max(errs):.3g}")


# --------------------------------------------------------------------------------------------
# shard_batch + parallelize on a model
# --------------------------------------------------------------------------------------------

_MODELS: dict[tuple[int, int], tuple] = {}


def _model(heads: int, kv_heads: int) -> tuple:
    """``(float64 tiny-llama, its precision floor)`` for a head count, built once per process."""
    if (heads, kv_heads) not in _MODELS:
        model = make_model(ModelCase(heads=heads, kv_heads=kv_heads))
        vocab = model.config.vocab_size
        packed = fuzz_batch(FuzzCase(0, 1, "model", "ulysses", 2, 17, heads, kv_heads, 8, True, None, "packed",
                                     "float64", "contiguous", "ok", None, 0), vocab, 0)[0]
        _MODELS[(heads, kv_heads)] = (model, precision_floor(model, packed))
    return _MODELS[(heads, kv_heads)]


def run_model(case: FuzzCase, meshes: dict[str, DeviceMesh]) -> Outcome:
    """A float64 tiny-llama under ``parallelize`` + ``shard_batch`` against the same model unsharded."""
    rank = dist.get_rank()
    model, floor = _model(case.heads, case.kv_heads)
    vocab = model.config.vocab_size
    batch, items = fuzz_batch(case, vocab, rank)
    strategy, layout = case.strategy, case.layout
    odd = case.odd if rank == case.odd_rank else None
    if odd == "strategy":
        strategy = "ring" if strategy != "ring" else "ulysses"
    if odd == "layout":
        layout = "zigzag" if layout != "zigzag" else "contiguous"
    mesh = meshes["hybrid" if strategy == "hybrid" else "flat"]
    reference = fuzz_reference(model, batch if case.invalid is None else None, case.world)
    row = compare_models(copy.deepcopy(model), batch, mesh, strategy=strategy, reference=reference, floor=floor,
                         layout=layout, num_items=items)
    if case.invalid is not None:
        return Outcome("inexact", f"rank {rank} ran through {case.invalid}")
    return Outcome("exact" if row["ok"] else "inexact",
                   f"loss diff {row['loss_diff']:.3g}, grad diff {row['grad_max']:.3g} ({row['worst_param']})")


# --------------------------------------------------------------------------------------------
# the loop on every rank, and the verdict
# --------------------------------------------------------------------------------------------

def fuzz_meshes(world: int) -> dict[str, DeviceMesh]:
    """The meshes the cases run on: ``flat`` (sp = world) and, at P = 4, ``hybrid`` (ring 2 x ulysses 2)."""
    meshes = {"flat": init_mesh(sp=world, device_type="cpu")}
    if world == 4:
        meshes["hybrid"] = init_mesh(sp=world, ulysses=2, ring=2, device_type="cpu")
    return meshes


def run_one(case: FuzzCase, meshes: dict[str, DeviceMesh]) -> Outcome:
    try:
        return (run_attention if case.target == "attention" else run_model)(case, meshes)
    except ValueError as e:
        return Outcome("ValueError", str(e))
    except Exception as e:  # anything else is a finding: a timeout first of all
        timeout = "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()
        return Outcome("timeout" if timeout else type(e).__name__, f"{type(e).__name__}: {str(e)[:2000]}")


def fuzz_worker(rank: int, world: int, seeds: list[int], log: str | None = None) -> list[dict]:
    """Worker entry (:func:`seqpar.comm.launch.run_distributed`): every seed's case on this rank, in
    order; stops after a case that ended in anything but a result or a ValueError (the group may be
    unusable then: the cases after it count as not run). ``log``: a file prefix each row is also
    appended to as it ends (``<log>.<rank>``, JSON lines), so a rank that dies (gloo aborts the
    process on some collective mismatches) leaves what it ran: :func:`read_log`."""
    torch.set_num_threads(1)
    meshes = fuzz_meshes(world)
    rows = []
    for seed in seeds:
        if log is not None:
            with open(f"{log}.{rank}", "a") as f:
                f.write(json.dumps({"seed": seed, "kind": "started"}) + "\n")
        out = run_one(draw(seed, world), meshes)
        rows.append({"seed": seed, **asdict(out)})
        if log is not None:
            with open(f"{log}.{rank}", "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
        if out.kind not in ("exact", "inexact", "ValueError"):
            break  # the group may be unusable (a peer timed out or died): stop here, the verdict says why
    return rows


def read_log(log: str, world: int) -> list[list[dict]]:
    """Every rank's rows from :func:`fuzz_worker`'s ``log`` after a rank died: a case a rank
    started and never ended is reported as ``died`` on that rank."""
    per_rank = []
    for rank in range(world):
        rows: list[dict] = []
        try:
            lines = [json.loads(line) for line in open(f"{log}.{rank}")]
        except OSError:
            lines = []
        for row in lines:
            if row["kind"] == "started":
                rows.append({"seed": row["seed"], "kind": "died", "detail": "the process died in this case"})
            else:
                rows[-1] = row
        per_rank.append(rows)
    return per_rank


def verdict(case: FuzzCase, outcomes: list[Outcome]) -> tuple[str, str | None]:
    """``(count key, problem or None)`` of one case from every rank's outcome."""
    kinds = {o.kind for o in outcomes}
    if kinds == {"exact"}:
        if case.invalid is not None:
            return "exact", f"{case.invalid}: exact on every rank, expected a ValueError"
        return "exact", None
    if kinds == {"ValueError"}:
        return f"ValueError[{case.invalid or _clean_kind(outcomes[0].detail)}]", None
    detail = "; ".join(f"rank {r}: {o.kind}: {o.detail[:300]}" for r, o in enumerate(outcomes))
    return "FAILED", detail


def _clean_kind(message: str) -> str:
    """A short name for a ValueError on a case without injected fault (S < P, head counts, ...)."""
    for key, name in (("without tokens", "S too short for P"), ("heads", "heads"), ("window", "window"),
                      ("no target", "no targets")):
        if key in message:
            return name
    return message.splitlines()[0][:60]


def problems(world: int, seeds: list[int], per_rank: list[list[dict]]) -> tuple[dict[str, int], list[str]]:
    """Counts by outcome and the failures (each with its case) over every rank's rows."""
    counts: dict[str, int] = {}
    bad = []
    for i, seed in enumerate(seeds):
        case = draw(seed, world)
        if any(i >= len(rows) for rows in per_rank):  # a rank stopped at an earlier failure
            counts["not run (after a failure)"] = counts.get("not run (after a failure)", 0) + 1
            continue
        rows = [rows[i] for rows in per_rank]
        key, problem = verdict(case, [Outcome(r["kind"], r["detail"]) for r in rows])
        counts[key] = counts.get(key, 0) + 1
        if problem is not None:
            bad.append(f"{case.label()}: {problem}")
    return counts, bad



def run_fuzz(world: int, seeds: list[int], *, pg_timeout: float = 10.0) -> list[list[dict]]:
    """Every seed's case on ``world`` local gloo processes; each rank's rows (a rank that died:
    its rows up to the case it died in, from the log)."""
    with tempfile.TemporaryDirectory(prefix="seqpar-fuzz-") as tmp:
        log = os.path.join(tmp, "rows")
        try:
            return run_distributed(fuzz_worker, world, seeds, log, timeout=60 + 4.0 * len(seeds),
                                   pg_timeout=pg_timeout)
        except WorkerError:
            return read_log(log, world)
