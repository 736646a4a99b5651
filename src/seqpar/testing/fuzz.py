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

import json
import os
import tempfile
from dataclasses import asdict

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..comm.launch import WorkerError, run_distributed
from ..comm.mesh import init_mesh
from .fuzz_attention import run_attention
from .fuzz_cases import FuzzCase, Outcome, draw
from .fuzz_model import run_model


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
