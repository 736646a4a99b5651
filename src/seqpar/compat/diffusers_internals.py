"""diffusers' private names seqpar touches (see :mod:`seqpar.compat`)."""

from __future__ import annotations

from typing import Any

# ---------------------------------------------------------------------------------------------
# diffusers
# ---------------------------------------------------------------------------------------------


def diffusers_cp_plan(cls: type) -> dict[str, dict[str | int, tuple[int, int | None]] | list[tuple[int, int | None]]
                                          ] | None:
    """A diffusers model class's context-parallel plan (``cls._cp_plan``; None when it declares none)
    as plain data: module path -> ``{input name or output index: (split_dim, expected_dims)}`` for the
    splits, or ``[(gather_dim, expected_dims), ...]`` for the gathered outputs. Reads diffusers'
    ``ContextParallelInput`` (``split_dim``, ``expected_dims``, ``split_output``: an int key is an
    output item, and only then) and ``ContextParallelOutput`` (``gather_dim``, ``expected_dims``)."""
    raw = getattr(cls, "_cp_plan", None)
    if raw is None:
        return None
    out: dict[str, Any] = {}
    for path, entry in raw.items():
        if isinstance(entry, dict):
            split = {}
            for key, item in entry.items():
                items = item if isinstance(item, (list, tuple)) else [item]
                if len(items) != 1 or bool(items[0].split_output) != isinstance(key, int):
                    raise ValueError(f"{cls.__name__}._cp_plan[{path!r}][{key!r}] is not one split of an input "
                                     "(by name) or of an output item (by index)")
                split[key] = (int(items[0].split_dim), items[0].expected_dims)
            out[path] = split
        else:
            items = entry if isinstance(entry, (list, tuple)) else [entry]
            out[path] = [(int(g.gather_dim), g.expected_dims) for g in items]
    return out
