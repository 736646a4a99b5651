"""Checks that must hold on every rank, made before a collective that would hang on a mismatch.

Each rank puts the facts it must agree on into one small row of numbers; one all-gather gives every
rank the whole table, and every rank then runs the *same* checks on the *same* table. So a rank
whose input is wrong and the ranks whose input is right raise the same ValueError -- no rank is
left waiting in a collective its peers never join.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2]
MISSING = -1.0


def dtype_code(dtype: torch.dtype) -> float:
    return float(_DTYPES.index(dtype)) if dtype in _DTYPES else 99.0


def dtype_name(code: float) -> str:
    c = int(code)
    return str(_DTYPES[c]).replace("torch.", "") if 0 <= c < len(_DTYPES) else "other"


def shape_fields(name: str, t: Tensor | None, ndim: int) -> dict[str, float]:
    """``{name.ndim, name.0, ..., name.dtype}`` for a tensor (MISSING entries when absent)."""
    out: dict[str, float] = {f"{name}.ndim": float(t.dim()) if t is not None else MISSING}
    for i in range(ndim):
        out[f"{name}.{i}"] = float(t.shape[i]) if t is not None and t.dim() > i else MISSING
    out[f"{name}.dtype"] = dtype_code(t.dtype) if t is not None else MISSING
    return out


def gather_rows(fields: dict[str, float], group: dist.ProcessGroup, device: torch.device) -> list[dict[str, float]]:
    """All-gather one row of named numbers; returns every rank's row (one collective)."""
    p = dist.get_world_size(group)
    row = torch.tensor([float(v) for v in fields.values()], dtype=torch.float64, device=device)
    if p == 1:
        return [dict(fields)]
    table = torch.empty(p * row.numel(), dtype=torch.float64, device=device)
    from .collectives import all_gather_flat

    all_gather_flat(table, row, group=group)
    values = table.view(p, -1).tolist()
    return [dict(zip(fields.keys(), vals, strict=True)) for vals in values]


def check_rows(rows: Sequence[dict[str, float]], *, same: Sequence[str], describe: Callable[[str], str],
               local: Callable[[int, dict[str, float]], str | None] | None = None, what: str = "input") -> None:
    """Raise one ValueError (identical on every rank) if a rank's row fails ``local`` or the ranks
    disagree on a field of ``same``. ``describe(field)`` says what a field is and how to fix it."""
    problems = []
    if local is not None:
        for r, row in enumerate(rows):
            msg = local(r, row)
            if msg:
                problems.append(f"rank {r}: {msg}")
    for name in same:
        vals = [row[name] for row in rows]
        if any(v != vals[0] for v in vals):
            shown = [dtype_name(v) if name.endswith("dtype") else _fmt(v) for v in vals]
            problems.append(f"{describe(name)} differs across ranks: {shown} (rank 0..{len(rows) - 1})")
    if problems:
        raise ValueError(f"seqpar: invalid {what}:\n  " + "\n  ".join(problems))


def _fmt(v: float) -> str:
    if v == MISSING:
        return "absent"
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


_ATTN_NAMES = {
    "q.ndim": "the rank of q", "q.0": "batch size of q", "q.2": "number of query heads",
    "q.3": "head dim of q", "q.dtype": "dtype of q", "k.2": "number of KV heads", "k.3": "head dim of k",
    "k.dtype": "dtype of k", "v.3": "head dim of v", "v.dtype": "dtype of v",
    "causal": "causal", "scale": "scale", "window": "window (sliding_window)", "softcap": "softcap",
    "dropout": "dropout", "mask.ndim": "whether a key padding mask is given",
    "seg.ndim": "whether segment ids are given", "shard": "whether a SeqShard is given",
}


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, spec,
                           key_padding_mask: Tensor | None = None, segment_ids: Tensor | None = None,
                           shard_len: int | None = None) -> tuple[int, ...]:
    """Validate sequence-parallel attention inputs on every rank at once (one all-gather).

    Layouts: ``q [B, S_local, H, D]``, ``k, v [B, S_local, H_kv, D]``, optional
    ``key_padding_mask`` / ``segment_ids [B, S_local]``. Returns every rank's local length.
    Raises the same ValueError on every rank if any rank's input is malformed or the ranks disagree.
    """
    def opt(x: float | None) -> float:
        return MISSING if x is None else float(x)

    fields = {**shape_fields("q", q, 4), **shape_fields("k", k, 4), **shape_fields("v", v, 4),
              **shape_fields("mask", key_padding_mask, 2), **shape_fields("seg", segment_ids, 2),
              "causal": float(spec.causal), "scale": opt(spec.scale), "window": opt(spec.window),
              "softcap": opt(spec.softcap), "dropout": float(spec.dropout),
              "shard": 0.0 if shard_len is None else 1.0, "shard_len": opt(shard_len)}
    rows = gather_rows(fields, group, q.device)

    def local(r: int, f: dict[str, float]) -> str | None:
        for name in ("q", "k", "v"):
            if f[f"{name}.ndim"] != 4:
                return f"{name} must be 4-D [batch, local_seq_len, heads, head_dim], got {int(f[f'{name}.ndim'])}-D"
        b, s, h, d = (int(f[f"q.{i}"]) for i in range(4))
        if (f["k.0"], f["k.1"]) != (b, s) or (f["v.0"], f["v.1"]) != (b, s):
            return (f"q, k, v must share batch and local_seq_len: q [{b}, {s}], k [{int(f['k.0'])}, {int(f['k.1'])}],"
                    f" v [{int(f['v.0'])}, {int(f['v.1'])}]")
        hk = int(f["k.2"])
        if f["v.2"] != hk:
            return f"k has {hk} heads but v has {int(f['v.2'])}"
        if hk < 1 or h % hk:
            return f"{h} query heads are not a multiple of {hk} KV heads (GQA needs H % H_kv == 0)"
        if f["k.3"] != d:
            return f"q head_dim {d} differs from k head_dim {int(f['k.3'])}"
        if not (f["q.dtype"] == f["k.dtype"] == f["v.dtype"]):
            return (f"q, k, v dtypes differ ({dtype_name(f['q.dtype'])}, {dtype_name(f['k.dtype'])},"
                    f" {dtype_name(f['v.dtype'])}): cast them to one dtype")
        for name, label in (("mask", "key_padding_mask"), ("seg", "segment_ids")):
            if f[f"{name}.ndim"] != MISSING and (f[f"{name}.ndim"], f[f"{name}.0"], f[f"{name}.1"]) != (2, b, s):
                return f"{label} must be [batch, local_seq_len] = [{b}, {s}]"
        if f["shard"] and f["shard_len"] != s:
            return (f"the SeqShard says this rank holds {int(f['shard_len'])} tokens but q holds {s}:"
                    " build the SeqShard from this batch")
        return None

    check_rows(rows, same=list(_ATTN_NAMES), local=local, what="attention input",
               describe=lambda n: _ATTN_NAMES[n])
    return tuple(int(row["q.1"]) for row in rows)


def shard_lengths(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, spec,
                  key_padding_mask: Tensor | None, segment_ids: Tensor | None, shard, validate: bool
                  ) -> tuple[int, ...]:
    """Every rank's local length: validated across ranks (:func:`check_attention_inputs`, one
    all-gather) when ``validate``, else taken from ``shard`` (or assumed equal to this rank's)."""
    if validate:
        me = dist.get_rank(group)
        return check_attention_inputs(q, k, v, group=group, spec=spec, key_padding_mask=key_padding_mask,
                                      segment_ids=segment_ids, shard_len=None if shard is None else shard.seq_lens[me])
    return tuple(shard.seq_lens) if shard is not None else (q.shape[1],) * dist.get_world_size(group)
