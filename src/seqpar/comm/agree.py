"""The one way seqpar makes ranks raise the same error together, before a collective could hang.

Each rank puts the facts that must agree into one row of numbers and, if its own input is wrong,
a problem text. One all-gather gives every rank the whole table; a second one, only when some
rank has a problem, carries the texts. Every rank then runs the *same* checks on the *same* table,
so a rank whose input is wrong and the ranks whose input is right raise the same ValueError -- no
rank is left waiting in a collective its peers never join. A problem that is a deliberate refusal
(:class:`seqpar.errors.Refused`: seqpar cannot run this exactly) says so in its row, and every rank
raises Refused when every problem was one::

    rank 0: facts {"len": 5, ...}, problem None          \\
    rank 1: facts {"len": 5, ...}, problem "q must be 4-D" -- all-gather --> Table on every rank
                                                                          --> check(table, same=[...])
                                                                              raises on every rank

:func:`fence` is the same path for a failure in the *middle* of a collective call (a kernel that
raised on one rank): the failing rank keeps the call's communication going with placeholders, then
every rank shares its verdict and raises together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import Refused
from . import collectives, faults

MISSING = -1.0
"""The value of a fact that does not apply (an absent tensor, an unset option)."""

_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2]


def dtype_code(dtype: torch.dtype) -> float:
    """A dtype as a number that can travel in a row of facts."""
    return float(_DTYPES.index(dtype)) if dtype in _DTYPES else 99.0


def dtype_name(code: float) -> str:
    c = int(code)
    return str(_DTYPES[c]).replace("torch.", "") if 0 <= c < len(_DTYPES) else "other"


def shape_facts(name: str, t: Tensor | None, ndim: int) -> dict[str, float]:
    """``{name.ndim, name.0, ..., name.dtype}`` of a tensor (MISSING entries when absent)."""
    out: dict[str, float] = {f"{name}.ndim": float(t.dim()) if t is not None else MISSING}
    for i in range(ndim):
        out[f"{name}.{i}"] = float(t.shape[i]) if t is not None and t.dim() > i else MISSING
    out[f"{name}.dtype"] = dtype_code(t.dtype) if t is not None else MISSING
    return out


@dataclass(frozen=True)
class Table:
    """Every rank's facts (``rows[r]``) and problem text (``problems[r]``, None where fine);
    ``refusals``: the ranks whose problem is a refusal (:class:`~seqpar.errors.Refused`)."""

    rows: list[dict[str, float]]
    problems: list[str | None]
    refusals: frozenset[int] = frozenset()

    def column(self, name: str) -> list[float]:
        return [row[name] for row in self.rows]


def share(facts: Mapping[str, float], group: dist.ProcessGroup, *, problem: str | None = None,
          refused: bool = False, device: torch.device | None = None) -> Table:
    """All-gather one row of named numbers and this rank's problem text, if any; ``refused``: the
    problem is a deliberate refusal (raised as :class:`~seqpar.errors.Refused` by :func:`check`).

    One collective when no rank has a problem, two when one does (the texts, padded to the
    longest). Every rank calls it with the same fact names, in the same order.
    """
    device = device or collectives.comm_device(group)
    text = (problem or "").encode()
    flag = (2.0 if refused else 1.0) if problem else 0.0  # 0: fine, 1: a problem, 2: a refusal
    values = [flag, float(len(text)), *(float(v) for v in facts.values())]
    table = _all_gather_row(torch.tensor(values, dtype=torch.float64, device=device), group).tolist()
    faults.raise_if_flagged()  # NCCL: a peer's fault made the watchdog abort the all-gather (garbage read)
    rows = [dict(zip(facts.keys(), vals[2:], strict=True)) for vals in table]
    problems: list[str | None] = [None] * len(table)
    longest = int(max(vals[1] for vals in table))
    if any(vals[0] for vals in table):
        padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
        padded[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else padded[:0]
        texts = _all_gather_row(padded, group)
        problems = [bytes(texts[r, :int(vals[1])].tolist()).decode(errors="replace") if vals[0] else None
                    for r, vals in enumerate(table)]
    return Table(rows, problems, frozenset(r for r, vals in enumerate(table) if vals[0] == 2.0))


def _all_gather_row(row: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[n] -> [P, n]``: every rank's row."""
    p = dist.get_world_size(group)
    if p == 1:
        return row[None]
    out = torch.empty(p * row.numel(), dtype=row.dtype, device=row.device)
    collectives.all_gather_flat(out, row, group=group)
    return out.view(p, -1)


def check(table: Table, *, what: str, same: Sequence[str] = (), describe: Callable[[str], str] = str,
          hint: str = "") -> None:
    """Raise one ValueError, identical on every rank, if a rank reported a problem or the ranks
    disagree on a fact of ``same``: :class:`~seqpar.errors.Refused` when every problem was a
    refusal and the ranks agree. ``describe(fact)`` says what a fact is and how to fix it; ``hint``
    closes the message when the ranks disagree."""
    problems = [f"rank {r}: {msg}" for r, msg in enumerate(table.problems) if msg]
    differ = []
    for name in same:
        vals = table.column(name)
        if any(v != vals[0] for v in vals):
            shown = [dtype_name(v) if name.endswith("dtype") else _fmt(v) for v in vals]
            differ.append(f"{describe(name)} differs across ranks: {shown} (rank 0..{len(vals) - 1})")
    if problems or differ:
        tail = f"\n  {hint}" if differ and hint else ""
        refused = not differ and all(r in table.refusals for r, msg in enumerate(table.problems) if msg)
        kind = Refused if refused else ValueError
        raise kind(f"seqpar: invalid {what}:\n  " + "\n  ".join(problems + differ) + tail)


def fence(groups: dist.ProcessGroup | Sequence[dist.ProcessGroup], error: BaseException | None, *,
          what: str) -> None:
    """Raise on every rank if ``error`` is set on any rank of ``groups``; return quietly otherwise.

    ``groups`` in stages (hybrid: the ulysses group, then the ring): each stage shares every
    failure seen so far, so after the last one every rank of the grid knows all of them. Cost:
    one tiny all-gather per stage (a second one only when some rank failed). The message is the
    same on every rank and names each failing rank (its global rank) and its error. The failing
    rank raises its own exception type (falling back to RuntimeError when that type cannot be
    built from a message), chained to the original; the others raise RuntimeError, or ValueError
    when a failing rank's error was one (bad input stays bad input), or :class:`~seqpar.errors.Refused`
    when every failing rank's error was one (a refusal stays a refusal on every rank; a refusal
    next to another failure is raised as a plain ValueError, as the other ranks raise it).
    """
    stages = [groups] if isinstance(groups, dist.ProcessGroup) else list(groups)
    problem = None if error is None else f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
    facts = {"value_error": float(isinstance(error, ValueError)),
             "not_refused": float(error is not None and not isinstance(error, Refused))}
    for group in stages:
        table = share(facts, group, problem=problem)
        problem = "\n".join(m for m in table.problems if m) or None
        facts = {name: max(table.column(name)) for name in facts}
    if problem is None:
        return
    text = f"seqpar: {what} failed, so every rank stops here:\n  " + problem.replace("\n", "\n  ")
    refused = not facts["not_refused"]  # every failing rank's error was a refusal
    if error is None:
        raise (Refused if refused else ValueError if facts["value_error"] else RuntimeError)(text)
    try:
        mine = ValueError(text) if isinstance(error, Refused) and not refused else type(error)(text)
    except Exception:
        mine = RuntimeError(text)
    raise mine from error


def _fmt(v: float) -> str:
    if v == MISSING:
        return "absent"
    return str(int(v)) if float(v).is_integer() else f"{v:g}"
