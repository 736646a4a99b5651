"""Checkpoints of a ``seqpar train`` run: torch.distributed.checkpoint, written so a crash never
leaves a half-written one where a resume would look.

Layout under ``<save_dir>/checkpoints/``::

    step_00000200/          complete: model + optimizer (DCP, sharded when FSDP is on),
      .metadata, *.distcp     trainer.pt (scheduler, step, options), rng_rank<r>.pt (per rank),
      config.json, tokenizer/ the model's transformers config and the run's tokenizer (seqpar export),
      manifest_rank<r>.json   each rank's files with their sizes and CRC-32s (:mod:`.manifest`)
    .tmp-step_00000300/     being written; renamed to step_00000300 only once every rank is done
    .replaced-step_00000200 a complete checkpoint of the same step moved aside while its re-save
                            commits (then deleted); counted as complete if the commit never came

The rename is the commit point: a directory named ``step_*`` is always complete, so Ctrl-C or a
dying worker at any moment leaves the previous checkpoint loadable, and a complete checkpoint is
never deleted before its replacement is committed. Each stage of a save ends with every rank
sharing whether it worked (:func:`seqpar.comm.agree.fence`): a failed write (a full disk, a
permission error) raises on every rank, names the rank and its error, and leaves the previous
checkpoints as they were.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from seqpar.comm import faults
from seqpar.comm.agree import fence

from .manifest import damage, files_of_rank, write_manifest
from .safe_load import PickledObject, check_plain, dcp_load, load_plain

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_REPLACED = re.compile(r"^\.replaced-step_(\d{8})$")
TRAINER_FILE = "trainer.pt"
TOKENIZER_DIR = "tokenizer"


def checkpoint_root(save_dir: str) -> str:
    return os.path.join(save_dir, "checkpoints")


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(save_dir), f"step_{step:08d}")


def complete_checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint, oldest first (a ``.replaced-`` one only when
    its step has no committed one: a save that died between its two renames)."""
    root = checkpoint_root(save_dir)
    if not os.path.isdir(root):
        return []
    found: dict[int, str] = {}
    for name in sorted(os.listdir(root), key=lambda n: n.startswith(".")):  # committed ones first
        m = _STEP_DIR.match(name) or _REPLACED.match(name)
        if m and int(m.group(1)) not in found and os.path.isfile(os.path.join(root, name, TRAINER_FILE)):
            found[int(m.group(1))] = os.path.join(root, name)
    return sorted(found.items())


def latest_checkpoint(save_dir: str) -> str | None:
    found = complete_checkpoints(save_dir)
    return found[-1][1] if found else None


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(save_dir: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, trainer_state: dict[str, Any], *, keep: int, model_config: Any = None,
                    tokenizer: Any = None, mesh: DeviceMesh | None = None) -> str:
    """Save on every rank (a collective); returns the committed directory. Keeps the ``keep``
    latest complete checkpoints. ``model_config`` (a transformers config) and ``tokenizer`` are
    written beside the weights, so the checkpoint alone can be exported (:mod:`.export`).
    ``mesh``: the run's mesh, needed for a model under expert parallelism (its shards are saved as
    rows of the whole stacked tensors, :mod:`.expert_state`); tensor-parallel and FSDP2 weights are
    DTensors already. Either way the checkpoint holds whole tensors' layouts: it loads at any other.

    Raises on every rank, the same message naming each failing rank and its error, when a rank
    cannot write (the previous checkpoints stay as they were, the partial one is removed)."""
    with faults.publishing("a checkpoint save"):
        return _save(save_dir, step, model, optimizer, scheduler, trainer_state, keep, model_config, tokenizer, mesh)


def _save(save_dir: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
          trainer_state: dict[str, Any], keep: int, model_config: Any, tokenizer: Any,
          mesh: DeviceMesh | None) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    final = step_dir(save_dir, step)
    tmp = os.path.join(checkpoint_root(save_dir), f".tmp-step_{step:08d}")
    what = f"the checkpoint save of step {step}"
    try:
        _stage(what, (lambda: _fresh_dir(tmp)) if rank == 0 else None)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        _present_experts(model, mesh, model_sd, optim_sd)
        try:
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        except dcp.CheckpointException as e:  # every rank gets it: DCP gathers the ranks' write results
            failed = "; ".join(f"rank {r}: {type(x[0]).__name__}: {x[0]}" for r, x in sorted(e.failures.items()))
            raise RuntimeError(f"seqpar: {what} failed in torch.distributed.checkpoint: {failed}") from e
        _stage(what, lambda: torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt")))
        if rank == 0:
            def meta() -> None:
                torch.save({**trainer_state, "step": step, "scheduler": scheduler.state_dict()},
                           os.path.join(tmp, TRAINER_FILE))
                if model_config is not None:
                    model_config.save_pretrained(tmp)
                if tokenizer is not None:
                    tokenizer.save_pretrained(os.path.join(tmp, TOKENIZER_DIR))
        _stage(what, meta if rank == 0 else None)
        extra = [n for n in os.listdir(tmp) if not _rank_file(n)] if rank == 0 else []
        _stage(what, lambda: write_manifest(tmp, rank, files_of_rank(tmp, rank, extra)))
        _stage(what, (lambda: _commit(save_dir, tmp, final, keep)) if rank == 0 else None)
    except Exception:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial save is never where a resume looks
        raise
    return final


def _stage(what: str, fn: Any) -> None:
    """Run this rank's part of a save stage (None: nothing to do), then raise on every rank if any
    rank's part failed -- one tiny all-gather (:func:`seqpar.comm.agree.fence`)."""
    error = None
    try:
        if fn is not None:
            fn()
    except Exception as e:  # shared with every rank by the fence, which raises it
        error = e
    fence(dist.group.WORLD, error, what=what)


def _fresh_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def _rank_file(name: str) -> bool:
    """A file one rank writes for itself (its DCP shards, RNG state, manifest)."""
    return (name.startswith("__") and name.endswith(".distcp")) or name.startswith(("rng_rank", "manifest_rank"))


def _commit(save_dir: str, tmp: str, final: str, keep: int) -> None:
    """Rank 0: make ``tmp`` the checkpoint ``final``. A complete checkpoint already there (a re-save
    of its step) is moved aside first and deleted only after the commit, so some complete one of
    that step exists at every moment; then the checkpoints beyond the ``keep`` latest go."""
    aside = os.path.join(os.path.dirname(final), f".replaced-{os.path.basename(final)}")
    if os.path.exists(final):
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)  # the commit point
    # the one moved aside just now, or by a save of this step that died before its commit
    shutil.rmtree(aside, ignore_errors=True)
    for _, path in complete_checkpoints(save_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def damaged(path: str) -> list[str]:
    """What is wrong with the checkpoint at ``path``, one line per damaged file (empty: intact; see
    :mod:`.manifest`). No process group needed. A file holding a pickled object is not damage:
    :class:`~seqpar.train.safe_load.PickledObject` (a ValueError naming it) is raised."""
    try:
        world = read_trainer_state(path).get("world")
    except PickledObject:
        raise
    except Exception as e:  # trainer.pt itself is damaged
        return [f"{TRAINER_FILE}: unreadable ({type(e).__name__}: {e})"]
    return damage(path, world)


def read_trainer_state(path: str) -> dict[str, Any]:
    """The small metadata file of a complete checkpoint (step, options, scheduler): plain data only
    (:func:`~seqpar.train.safe_load.load_plain`; a pickled object raises ValueError naming the file)."""
    return load_plain(os.path.join(path, TRAINER_FILE))


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *,
                    mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG (a collective); returns the trainer
    state (``step`` and the options the run was started with). The checkpoint may come from another
    layout (dp, sp, tp, ep, FSDP2): DCP reads each rank's part of the whole tensors. ``mesh``: as
    for :func:`save_checkpoint`.

    Reads data only: a file of the checkpoint that holds a pickled object raises ValueError naming
    it on every rank (checked by every rank, agreed in one fence), before anything is loaded."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .expert_state import unwrap

    _stage("reading the checkpoint " + path, lambda: check_plain(path))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    experts = _present_experts(model, mesh, model_sd, optim_sd)
    state = {"model": model_sd, "optim": optim_sd}
    dcp_load(state, path)
    unwrap(experts, state["model"], state["optim"])
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer = read_trainer_state(path)
    scheduler.load_state_dict(trainer["scheduler"])
    rng = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if os.path.isfile(rng):
        _set_rng_state(load_plain(rng))
    return trainer


def _present_experts(model: nn.Module, mesh: DeviceMesh | None, model_sd: dict[str, Any],
                     optim_sd: dict[str, Any]) -> list[str]:
    """Expert shards as rows of their whole tensors (:func:`seqpar.train.expert_state.present`)."""
    from .expert_state import expert_params, present

    if mesh is None:
        if expert_params(model):
            raise ValueError("a model under expert parallelism is saved and loaded with its mesh: pass mesh=")
        return []
    return present(model, mesh, model_sd, optim_sd)


def load_model_weights(path: str, model: nn.Module) -> nn.Module:
    """Load a checkpoint's weights into a plain (unsharded) ``model`` in a single process -- no
    process group needed; e.g. to evaluate or export a trained model."""
    import warnings

    check_plain(path)  # data only: a pickled object is a ValueError naming its file
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": single process is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(state, path, no_dist=True)
    model.load_state_dict(state["model"])
    return model
