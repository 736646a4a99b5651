"""Attention inputs checked on every rank at once, before the collectives that would hang on them.

The facts every rank must agree on (heads, head dims -- v's may differ from q's and k's --, dtypes,
options, the shape of the attention sinks) and each rank's own shape problems travel in one
all-gather (:mod:`seqpar.comm.agree`); every rank raises the same error.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from ..comm.agree import MISSING, check, dtype_name, shape_facts, share
from .spec import AttnSpec

_ATTN_NAMES = {
    "q.ndim": "the rank of q", "q.0": "batch size of q", "q.2": "number of query heads",
    "q.3": "head dim of q", "q.dtype": "dtype of q", "k.2": "number of KV heads", "k.3": "head dim of k",
    "k.dtype": "dtype of k", "v.3": "head dim of v", "v.dtype": "dtype of v",
    "causal": "causal", "scale": "scale", "window": "window (sliding_window)", "softcap": "softcap",
    "dropout": "dropout", "chunk": "chunk (attention_chunk_size)", "sinks.ndim": "whether sinks are given",
    "sinks.0": "number of sinks", "sinks.dtype": "dtype of sinks", "mask.ndim": "whether a key padding mask is given",
    "seg.ndim": "whether segment ids are given", "shard": "whether a SeqShard is given",
    "how": "the strategy, layout or ring comm (each rank must run the same: strategy=, layout=, comm=)",
}


def plan_code(*names: str | None) -> float:
    """One number for the choices that decide which collectives run (strategy, layout, ring comm),
    exact in float64: ranks that chose differently would pair different collectives and hang."""
    return float(sum(ord(c) * 131 ** i for i, c in enumerate("/".join(n or "-" for n in names))) % 2**52)


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, spec: AttnSpec,
                           key_padding_mask: Tensor | None = None, segment_ids: Tensor | None = None,
                           shard_len: int | None = None, how: float = 0.0) -> tuple[int, ...]:
    """Validate sequence-parallel attention inputs on every rank at once (one all-gather).

    Layouts: ``q [B, S_local, H, D]``, ``k [B, S_local, H_kv, D]``, ``v [B, S_local, H_kv, Dv]``,
    optional ``key_padding_mask`` / ``segment_ids [B, S_local]`` and ``spec.sinks [H]``. Returns
    every rank's local length. ``how``: the call's :func:`plan_code` (the same on every rank).
    Raises the same ValueError on every rank if any rank's input is malformed or the ranks disagree.
    """
    def opt(x: float | None) -> float:
        return MISSING if x is None else float(x)

    facts = {**shape_facts("q", q, 4), **shape_facts("k", k, 4), **shape_facts("v", v, 4),
             **shape_facts("mask", key_padding_mask, 2), **shape_facts("seg", segment_ids, 2),
             **shape_facts("sinks", spec.sinks, 2), "chunk": opt(spec.chunk),
             "causal": float(spec.causal), "scale": opt(spec.scale), "window": opt(spec.window),
             "softcap": opt(spec.softcap), "dropout": float(spec.dropout),
             "shard": 0.0 if shard_len is None else 1.0, "shard_len": opt(shard_len), "how": how}
    table = share(facts, group, problem=_problem(facts), device=q.device)
    check(table, same=list(_ATTN_NAMES), what="attention input", describe=lambda n: _ATTN_NAMES[n])
    return tuple(int(row["q.1"]) for row in table.rows)


def _problem(f: dict[str, float]) -> str | None:
    """What is wrong with this rank's own attention input (no communication), or None."""
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
    if f["chunk"] != MISSING and f["chunk"] < 1:
        return f"chunk (attention_chunk_size) must be a positive number of tokens, got {f['chunk']:g}"
    if f["sinks.ndim"] != MISSING and (f["sinks.ndim"], f["sinks.0"]) != (1, h):
        shape = [int(f[f"sinks.{i}"]) for i in range(2) if f[f"sinks.{i}"] != MISSING]
        return f"sinks must be [num_query_heads] = [{h}] (one logit per query head), got shape {shape}"
    if f["shard"] and f["shard_len"] != s:
        return (f"the SeqShard says this rank holds {int(f['shard_len'])} tokens but q holds {s}:"
                " build the SeqShard from this batch")
    return None


def check_grid_inputs(q: Tensor, k: Tensor, v: Tensor, ulysses_group: dist.ProcessGroup,
                      ring_group: dist.ProcessGroup, *, spec: AttnSpec, key_padding_mask: Tensor | None,
                      segment_ids: Tensor | None, shard_len: int | None, how: float = 0.0) -> tuple[int, ...]:
    """Validate over a whole ``ring x ulysses`` grid so every rank raises the same ValueError.

    1. Each ulysses group checks its ranks' inputs (one all-gather); an error is kept, not raised.
    2. The ring group shares every ulysses group's verdict, lengths and message (one all-gather):
       every rank sees the same table and raises the same error if any group failed.
    3. All inputs are well-formed now; the ring group checks that the groups agree (same heads,
       dtype, options), which every ring group sees alike. Returns all sp ranks' local lengths.
    """
    kw = dict(spec=spec, key_padding_mask=key_padding_mask, segment_ids=segment_ids, shard_len=shard_len, how=how)
    n_u = dist.get_world_size(ulysses_group)
    try:
        lens, err = check_attention_inputs(q, k, v, group=ulysses_group, **kw), None
    except ValueError as e:
        lens, err = (0,) * n_u, str(e)
    table = share({f"len{i}": float(n) for i, n in enumerate(lens)}, ring_group, problem=err, device=q.device)
    if any(table.problems):
        raise ValueError("\n".join(f"in the ulysses group of ring rank {i}: {m}"
                                   for i, m in enumerate(table.problems) if m))
    try:
        check_attention_inputs(q, k, v, group=ring_group, **kw)
    except ValueError as e:
        raise ValueError(f"{e}\n  (ranks counted along the ring axis: ring rank i holds sp ranks"
                         f" {n_u}*i .. {n_u}*i+{n_u - 1})") from None
    return tuple(int(n) for row in table.rows for n in row.values())
