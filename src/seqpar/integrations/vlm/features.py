"""A vision encoder's output as feature rows, and back: what one exchange carries per placeholder.

The base model's ``get_<modality>_features`` returns a ``BaseModelOutputWithPooling`` (or a
family's subclass) whose ``pooler_output`` holds the rows merged at the placeholder tokens, per
image (a list) or stacked (a tensor). Deepstack families (Qwen3-VL, Qwen3-Omni, Cosmos3-Omni)
also return ``deepstack_features``: one list of per-image rows per early decoder layer, added to
the same placeholder tokens' hidden states after that layer; Granite 4 Vision returns only
``(decoder layer, per-image rows)`` pairs (the placeholders start at zero and every pair is added
at its layer). Every stream has one row per placeholder, in the same order, so the streams
travel side by side::

    encoder output   pooler_output [n, E], deepstack_features [[n, E_1], ..., [n, E_k]]
      rows           [n, E + E_1 + ... + E_k]     (one routed row per placeholder)
      route          each row to the rank whose shard holds its placeholder (seqpar.comm.route)
    this rank        rows [m, E + ...] -> the family's own output class, pooler_output [[m, E]],
                     deepstack_features [[[m, E_1]], ...]: the model's forward merges the main rows
                     and hands the deepstack rows of its local placeholders to its decoder layers
                     (visual_pos_masks from its local input_ids: this shard's positions)

Gradients flow back through the concatenation to each stream (the tower's deepstack mergers too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class FeatureLayout:
    """How a family's encoder output maps to routed rows: ``output``, its output class;
    ``stacked``: its pooler_output is one tensor (not a list per image); ``widths``: the row
    width of each stream, the main features first, then each deepstack layer's; ``deepstack``:
    the output has deepstack features (a list, possibly empty, that the model's forward reads)."""

    output: type
    stacked: bool
    widths: tuple[int, ...]
    deepstack: bool = False
    layers: tuple[int, ...] | None = None  # Granite 4 Vision: each stream's decoder layer, no pooler_output

    @property
    def width(self) -> int:
        return sum(self.widths)


def _flat(pooled: Any) -> Tensor:
    """Per-image rows (a list of ``[n_i, E]``, or a tensor ``[N, n, E]``) -> ``[sum n_i, E]`` in order."""
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in pooled])


def _rows_list(x: Any) -> bool:
    return isinstance(x, Tensor) or (isinstance(x, (list, tuple)) and all(isinstance(t, Tensor) for t in x))


def _layered(out: Any) -> bool:
    """Granite 4 Vision's output: no pooler_output, ``(decoder layer, per-image rows)`` pairs."""
    deep = getattr(out, "deepstack_features", None)
    return getattr(out, "pooler_output", None) is None and bool(deep) and all(
        isinstance(d, tuple) and len(d) == 2 and isinstance(d[0], int) and _rows_list(d[1]) for d in deep)


def deepstack_problem(out: Any) -> str | None:
    """Why seqpar cannot route this encoder output, or None: a pooler_output with deepstack
    features as per-layer lists of per-image rows (Qwen3-VL) or none, or layered pairs only."""
    if _layered(out):
        return None
    if getattr(out, "pooler_output", None) is None:
        return "an image encoder output without pooler_output"
    deep = getattr(out, "deepstack_features", None)
    if not deep or all(_rows_list(layer) for layer in deep):
        return None
    return "deepstack features that are neither per-layer lists of per-image rows nor (decoder layer, rows) pairs"


def encoder_rows(model: nn.Module, modality: str, inputs: dict[str, Tensor]) -> tuple[Tensor, FeatureLayout]:
    """``(rows [n, E + deepstack widths], layout)`` of one encoder call -- the base model's
    ``get_<modality>_features``, the entry transformers' generate uses. Raises ValueError for a
    deepstack output seqpar cannot route (:func:`deepstack_problem`)."""
    fn = getattr(model.base_model, f"get_{modality}_features", None) or getattr(model, f"get_{modality}_features")
    out = fn(**inputs, return_dict=True)
    problem = deepstack_problem(out)
    if problem is not None:
        raise ValueError(f"seqpar: {type(model).__name__}: {problem}")
    deep = getattr(out, "deepstack_features", None)
    if _layered(out):
        streams = [_flat(rows) for _, rows in deep]
        layout = FeatureLayout(type(out), False, tuple(int(s.shape[1]) for s in streams), True,
                               tuple(layer for layer, _ in deep))
        return torch.cat(streams, dim=1), layout
    streams = [_flat(out.pooler_output)] + [_flat(layer) for layer in deep or []]
    layout = FeatureLayout(type(out), isinstance(out.pooler_output, Tensor), tuple(int(s.shape[1]) for s in streams),
                           deep is not None)
    return torch.cat(streams, dim=1), layout


def encoder_output(rows: Tensor, layout: FeatureLayout) -> Any:
    """This rank's routed ``rows [m, layout.width]`` as the family's encoder output (see the module
    doc): the container the model's forward reads from ``mm_encoder_outputs``."""
    streams = list(rows.split(list(layout.widths), dim=1))
    if layout.layers is not None:
        return layout.output(deepstack_features=[(layer, [s]) for layer, s in zip(layout.layers, streams, strict=True)])
    main = streams[0][None] if layout.stacked else [streams[0]]
    if not layout.deepstack:
        return layout.output(pooler_output=main)
    return layout.output(pooler_output=main, deepstack_features=[[s] for s in streams[1:]])
