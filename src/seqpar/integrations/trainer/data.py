"""The Trainer's data under sequence parallelism: its loaders and each step's batches.

::

    loaders     the train loader split over dp only (every SP rank of a dp group reads the same
                batches); eval / predict loaders unsplit, gather_for_metrics' cut of the last
                batch's copies kept without its gather
    batches     the keys shard_batch reads (the padding-free collators' derived ones dropped); one
                all-gather over all ranks checks that every SP group holds the same micro-batches

:mod:`seqpar.integrations.trainer.mixin` (the mixin) calls these from the Trainer's public hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ... import compat
from ...batch.local_batch import BATCH_KWARG
from ...batch.targets import CU_SEQLENS_KEYS
from ...batch.validate import BATCH_KEYS, checksum
from ...batch.visual import ROUTED_KEYS, fingerprint, refused_key_problem
from ...comm.agree import Table, check, share
from ...comm.mesh import mesh_dims
from ...errors import Refused

DERIVED_KEYS = ("max_length_q", "max_length_k", "seq_idx")
"""Keys of TRL's / transformers' padding-free collators that follow from ``cu_seq_lens_*`` (which
``shard_batch`` checks against the position ids): dropped, seqpar derives what it needs."""


def split_loader(loader: Any, num: int, index: int) -> Any:
    """Make an accelerate-prepared DataLoader hand out ``index``'s share of ``num`` (dp) instead
    of the process's share of all processes (:func:`seqpar.compat.split_prepared_loader`)."""
    from accelerate.data_loader import DataLoaderDispatcher

    if isinstance(loader, DataLoaderDispatcher):
        raise ValueError("seqpar's Trainer integration splits the data over dp itself: set "
                         "TrainingArguments(accelerator_config={'dispatch_batches': False})")
    if not compat.split_prepared_loader(loader, num, index) and dist.get_world_size() > 1:
        raise Refused(f"seqpar cannot split this data loader ({type(loader).__name__}) over dp: use a "
                      "map-style or iterable dataset through the Trainer's own get_*_dataloader")
    return loader


def drop_remainder(state: Any, data: Any) -> Any:
    """accelerate's ``gather_for_metrics`` without the gather: at the end of the loader, ``data``'s
    rows past the dataset's last sample are dropped (``state``: the accelerator's gradient_state)."""
    from accelerate.utils import recursively_apply

    if state.end_of_dataloader and state.remainder > 0:
        return recursively_apply(lambda t: t[:state.remainder], data)
    return data


def model_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keys ``shard_batch`` reads (others it refuses with a clear error), without the padding-free
    collators' derived ones."""
    return {k: v for k, v in batch.items() if k not in DERIVED_KEYS}


def check_sp_groups(batches: list[Mapping[str, Any]], expected: int, mesh: DeviceMesh,
                    extra_keys: tuple[str, ...] = ()) -> None:
    """Every rank of an SP group must hold the same micro-batches; raise on every rank if not.

    One all-gather of a row of facts over all ranks (not only the SP group: a failing group must
    not leave the other dp groups waiting in the gradient all-reduce), then the same verdict on
    every rank from the same table. A vision-language collator's images (``pixel_values``, grids,
    ``mm_token_type_ids``: :data:`~seqpar.batch.visual.ROUTED_KEYS`) are compared too; a key of a
    mechanism seqpar does not run (:data:`~seqpar.batch.visual.REFUSED_KEYS`) is a Refused.
    ``extra_keys``: a TRL trainer's own columns (DPO's ``completion_mask``...), compared too."""
    facts: dict[str, float] = {"count": float(len(batches))}
    problem, refused = None, False
    for m in range(expected):
        b = batches[m] if m < len(batches) else None
        ids = b.get("input_ids") if b is not None else None
        ok = isinstance(ids, Tensor) and ids.dim() == 2
        facts[f"{m}.batch"] = float(ids.shape[0]) if ok else -1.0
        facts[f"{m}.seq"] = float(ids.shape[1]) if ok else -1.0
        facts[f"{m}.ids"] = checksum(ids) if ok else -1.0
        visual = {k: b[k] for k in ROUTED_KEYS if isinstance(b.get(k), Tensor)} if b is not None else {}
        facts[f"{m}.visual"] = fingerprint(visual)
        own = {k: b[k] for k in extra_keys if isinstance(b.get(k), Tensor)} if b is not None else {}
        facts[f"{m}.extra"] = fingerprint(own)
        if b is None or problem is not None:
            continue
        known = {*BATCH_KEYS, *CU_SEQLENS_KEYS, *DERIVED_KEYS, *ROUTED_KEYS, BATCH_KWARG, *extra_keys}
        unknown = set(b) - known
        mechanism = refused_key_problem(b)
        if mechanism is not None:  # e.g. Gemma 3's token_type_ids: a refusal, not a malformed batch
            problem, refused = f"micro-batch {m}: {mechanism}", True
        elif not ok or unknown:
            problem = (f"micro-batch {m} has no [batch, seq_len] input_ids" if not ok else
                       f"the collator's batch has keys seqpar cannot shard: {sorted(unknown)} (it shards "
                       f"{list(BATCH_KEYS)}, {list(CU_SEQLENS_KEYS)} and a vision-language processor's "
                       f"{list(ROUTED_KEYS)}); drop them in the collator")
    table = share(facts, dist.group.WORLD, problem=problem, refused=refused)
    check(table, what="Trainer batches")  # a malformed batch anywhere: every rank raises
    names = {f"{m}.{k}": f"micro-batch {m}'s {what}" for m in range(expected)
             for k, what in (("batch", "batch size"), ("seq", "sequence length"), ("ids", "content (input_ids)"),
                             ("visual", f"images (its {list(ROUTED_KEYS)})"),
                             ("extra", f"columns {list(extra_keys)}"))}
    names["count"] = "number of micro-batches in the step"
    for ranks in sp_groups(mesh):  # every rank checks every group: the same verdict everywhere
        check(Table([table.rows[r] for r in ranks], [None] * len(ranks)),
              what=f"Trainer batches of the SP group of ranks {ranks}", same=list(names), describe=names.__getitem__,
              hint="the ranks of one SP group must get the same batches: a collator with per-rank randomness, "
                   "or a data loader sharded over every rank instead of over dp")


def sp_groups(mesh: DeviceMesh) -> list[list[int]]:
    """The global ranks of every group of ``mesh`` that holds one batch: an SP group, with its tp
    ranks on an N-D mesh (the dp dimensions first, the rest flattened)."""
    return mesh.mesh.reshape(mesh_dims(mesh).dp, -1).tolist()
