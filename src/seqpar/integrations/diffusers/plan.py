"""Where a diffusers transformer's sequence is split and where it leaves: a :class:`ShardPlan`.

The plan has the shape of diffusers' own ``_cp_plan`` metadata (module path -> the inputs or outputs
to split there, and the module whose output is gathered), plus one thing diffusers leaves implicit:
the *sequence* each split belongs to (``"image"``, ``"text"``). Every split of one sequence gets the
same shard lengths, and an attention layer's global shard lengths are the sum of its sequences'::

    model(hidden_states [B, N, C], encoder_hidden_states [B, T, C], img_ids [N, 3], txt_ids [T, 3])
      ""          hidden_states, img_ids  -> "image"  N split as (4, 3) over 2 ranks   (N = 7)
                  encoder_hidden_states, txt_ids -> "text"  T split as (3, 2)      (T = 5)
      blocks      joint attention over text + image: shard lengths (3 + 4, 2 + 3) = (7, 5)
      proj_out    leaves: "image" gathered along dim 1 (drop-in) or kept (sharded)

A model that declares ``_cp_plan`` is planned from it (:func:`from_cp_plan`, through
:func:`seqpar.compat.diffusers_cp_plan`); one that does not gets a plan written in
:mod:`.families`. Shard lengths follow ``torch.tensor_split`` (the first ``n % P`` ranks hold one
more), so any token count splits: no divisibility by P.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from ... import compat
from ...errors import Refused


@dataclass(frozen=True)
class Split:
    """Split a tensor along ``dim`` as sequence ``seq``; ``ndim``: only a tensor of that many
    dimensions (another passes whole, as diffusers' ``expected_dims``: Wan's timestep is split
    only when it is per token)."""

    seq: str
    dim: int
    ndim: int | None = None


@dataclass(frozen=True)
class Gather:
    """Where sequence ``seq`` leaves the sharded region: the output of the plan's exit module,
    along ``dim`` (``ndim`` as in :class:`Split`)."""

    seq: str
    dim: int
    ndim: int | None = None


@dataclass(frozen=True)
class ShardPlan:
    """``splits``: module path (``""`` the model itself, ``"*"`` any item of a ModuleList) -> key ->
    :class:`Split`, where a str key names an input of the module's forward and an int key an item
    of its output. ``exit``: the module path whose output leaves the sharded region, and how."""

    splits: Mapping[str, Mapping[str | int, Split]]
    exit: tuple[str, Gather]
    sequences: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        seqs = {s.seq for entry in self.splits.values() for s in entry.values()}
        object.__setattr__(self, "sequences", tuple(sorted(seqs)))


DEFAULT_SEQUENCES: dict[str, str] = {
    "hidden_states": "image", "img_ids": "image", "timestep": "image", "image_rotary_emb": "image",
    "encoder_hidden_states": "text", "txt_ids": "text", "encoder_hidden_states_mask": "text",
    "encoder_attention_mask": "text",
}
"""The sequence an input of a ``_cp_plan`` belongs to, by its name (output items and other names are
labelled per family, :mod:`.families`)."""


def from_cp_plan(model: nn.Module, labels: Mapping[str, str] | None = None) -> ShardPlan:
    """The plan of a model that declares diffusers' ``_cp_plan``: its splits and its gather, each
    labelled with its sequence (``labels``: ``"module:key"`` or ``"key"`` -> sequence, over
    :data:`DEFAULT_SEQUENCES`; a gather is labelled ``"image"`` unless ``labels`` names its module).
    Raises Refused for an entry no label covers or a plan with other than one gather."""
    raw = compat.diffusers_cp_plan(type(model))
    assert raw is not None, f"{type(model).__name__} declares no _cp_plan"
    names = {**DEFAULT_SEQUENCES, **(labels or {})}
    splits: dict[str, dict[str | int, Split]] = {}
    exits = []
    for path, entry in raw.items():
        if isinstance(entry, list):  # gathers: [(dim, ndim), ...]
            exits += [(path, Gather(names.get(path, "image"), dim, ndim)) for dim, ndim in entry]
            continue
        for key, (dim, ndim) in entry.items():
            seq = names.get(f"{path}:{key}", names.get(str(key)))
            if seq is None:
                raise Refused(f"{type(model).__name__}'s _cp_plan splits {key!r} of {path or 'the model'!r}, whose "
                              "sequence seqpar does not know: this class is not supported by seqpar's diffusers "
                              "integration yet")
            splits.setdefault(path, {})[key] = Split(seq, dim, ndim)
    if len(exits) != 1:
        raise Refused(f"{type(model).__name__}'s _cp_plan gathers {len(exits)} outputs; seqpar supports one exit")
    return ShardPlan(splits, exits[0])


def modules_at(model: nn.Module, path: str) -> list[nn.Module]:
    """The modules a plan path names (``""``: the model; ``"*"``: every item of a ModuleList).
    Raises Refused when the path names none (a plan that does not fit the model)."""
    found = [model]
    for atom in path.split(".") if path else []:
        nxt: list[nn.Module] = []
        for m in found:
            if atom == "*":
                nxt += list(m.children()) if isinstance(m, nn.ModuleList) else []
            elif isinstance(getattr(m, atom, None), nn.Module):
                nxt.append(getattr(m, atom))
        found = nxt
    if not found:
        raise Refused(f"{type(model).__name__} has no module {path!r} for seqpar's shard plan")
    return found
