"""A checkpoint is data, never code: every file of one is read as tensors and plain data only.

A pickle names the callables it wants run (GLOBAL / STACK_GLOBAL / INST); unpickling calls them, so
a checkpoint directory handed over by someone else could run anything. :func:`check_plain` lists
what each pickled file of a checkpoint names *without unpickling it* (``pickletools``) and raises
:class:`PickledObject` naming the file when that is more than tensors and plain data:

    trainer.pt, rng_rank<r>.pt   torch.save zips: torch's weights-only set (+ :data:`TRAINER_TYPES`)
    .metadata                    DCP's raw pickle: its metadata dataclasses, dtypes, Size, paths
                                 (:data:`seqpar.compat.DCP_METADATA_GLOBALS`)

The reads themselves are restricted too: ``torch.load(weights_only=True)`` for the ``.pt`` files, and
:func:`dcp_load` wraps ``torch.distributed.checkpoint.load`` so that its ``.metadata`` and its
non-tensor items (optimizer hyper-parameters) pass the same check before DCP unpickles them (DCP's
own reader uses ``pickle.load`` / ``torch.load(weights_only=False)`` there).
"""

from __future__ import annotations

import io
import os
import pickletools
import zipfile
from typing import Any

import torch

from seqpar.compat import DCP_METADATA_GLOBALS

from .report import EvalResult

METADATA_FILE = ".metadata"
_DCP_MODULE = "torch.distributed.checkpoint.metadata"


class PickledObject(ValueError):
    """A checkpoint file holds a pickled object (a callable to run at load), not only data."""


def _trainer_types() -> list[type | tuple[type, str]]:
    """Our own plain records a trainer state holds: :class:`EvalResult`, also under the name it had
    in checkpoints written before it moved to report.py (``seqpar.train.loop.EvalResult``)."""
    return [EvalResult, (EvalResult, "seqpar.train.loop.EvalResult")]


def pickled_globals(data: bytes) -> set[str] | None:
    """``module.name`` of every global the pickle ``data`` names (``"?"`` for one that cannot be
    told without running it); None when ``data`` is not a whole pickle (garbage, truncated)."""
    names: set[str] = set()
    # STACK_GLOBAL takes module and name from the stack: known only when the two ops before it
    # pushed strings (directly or from the memo); ``window`` holds those pushes, any other op clears it
    window: list[str | None] = []
    memo: dict[int, str | None] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("GLOBAL", "INST"):
                names.add(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL":
                m, n = window[-2:] if len(window) >= 2 else (None, None)
                names.add(f"{m}.{n}" if m is not None and n is not None else "?")
            elif op.name.startswith("EXT"):  # copyreg's extension registry: a callable by number
                names.add("?")
            if op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):  # no stack change
                memo[len(memo) if op.name == "MEMOIZE" else int(arg)] = window[-1] if window else None
            elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                window.append(memo.get(int(arg)))
            elif "UNICODE" in op.name or "STRING" in op.name:
                window.append(arg if isinstance(arg, str) else None)
            elif op.name not in ("PROTO", "FRAME"):
                window = []
    except Exception:  # pickletools raises ValueError and others on bytes that are not a pickle
        return None
    return names


def _unsafe_in(path: str, name: str) -> list[str]:
    """What the file ``name`` of the checkpoint at ``path`` names beyond plain data ([]: nothing, or
    not a pickle at all -- unreadable files are the manifest check's to report)."""
    full = os.path.join(path, name)
    try:
        with open(full, "rb") as f:
            data = f.read()
    except OSError:
        return []
    if name == METADATA_FILE:
        found = pickled_globals(data) or set()
        return sorted(g for g in found if g not in DCP_METADATA_GLOBALS and not _dcp_plain(g))
    if zipfile.is_zipfile(io.BytesIO(data)):  # torch.save's format: its weights-only set decides
        try:
            with torch.serialization.safe_globals(_trainer_types()):
                return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
        except Exception:  # a damaged zip
            return []
    return sorted(pickled_globals(data) or ())  # a raw pickle where seqpar writes a torch.save zip


def _dcp_plain(name: str) -> bool:
    """A dataclass / enum of DCP's metadata module or a torch dtype."""
    import torch.distributed.checkpoint.metadata as dcp_metadata

    module, _, attr = name.rpartition(".")
    if module == _DCP_MODULE:  # a class defined there (not a helper it imported)
        return getattr(getattr(dcp_metadata, attr, None), "__module__", None) == _DCP_MODULE
    return module == "torch" and isinstance(getattr(torch, attr, None), torch.dtype)


def refusal(file: str, names: list[str]) -> PickledObject:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return PickledObject(f"{file} holds a pickled object ({shown}), not only tensors and plain data: seqpar does "
                         "not load it, since unpickling it would run code. A checkpoint seqpar train wrote holds "
                         "none; use a checkpoint from a source you trust, or delete this one")


def check_plain(path: str) -> None:
    """Raise :class:`PickledObject` naming the first file of the checkpoint at ``path`` whose pickle
    names more than tensors and plain data (trainer state, each rank's RNG state, DCP's metadata).
    Nothing is unpickled. No process group needed."""
    names = sorted(n for n in os.listdir(path) if n.endswith(".pt") or n == METADATA_FILE)
    for name in names:
        bad = _unsafe_in(path, name)
        if bad:
            raise refusal(os.path.join(path, name), bad)


def load_plain(file: str) -> Any:
    """``torch.load`` of a checkpoint's small ``.pt`` file, tensors and plain data only (and the
    trainer's own records): :class:`PickledObject` naming the file for anything else."""
    bad = _unsafe_in(os.path.dirname(file), os.path.basename(file))
    if bad:
        raise refusal(file, bad)
    with torch.serialization.safe_globals(_trainer_types()):
        return torch.load(file, map_location="cpu", weights_only=True)


def dcp_load(state: dict[str, Any], path: str, *, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load(state, checkpoint_id=path)`` reading only data: its
    ``.metadata`` and each non-tensor item pass :func:`pickled_globals` first. A refusal raises
    :class:`PickledObject` (on every rank: DCP shares each rank's failure with all)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # checked here, then read by DCP's own pickle.load: the same bytes, only allowed names in them
            rank = kwargs.get("rank")
            name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
            bad = _unsafe_in(str(self.path), name)
            if bad:
                raise refusal(os.path.join(str(self.path), name), bad)
            return super().read_metadata(*args, **kwargs)

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:  # weights-only first: refuses any callable before the default planner unpickles
                torch.load(value, weights_only=True)
            except Exception as e:
                where = getattr(self.metadata.storage_data.get(read_item.storage_index), "relative_path", "")
                why = f"{read_item.dest_index.fqn}: {str(e).splitlines()[-1][:200]}"
                raise refusal(os.path.join(path, where), [why]) from None
            value.seek(0)
            super().load_bytes(read_item, value)

    try:
        dcp.load(state, storage_reader=Reader(path), planner=Planner(), no_dist=no_dist)
    except dcp.CheckpointException as e:
        refused = [x[0] for _, x in sorted(e.failures.items()) if isinstance(x[0], PickledObject)]
        if refused:
            raise PickledObject(str(refused[0])) from e
        raise
