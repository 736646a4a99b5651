"""Checkpoints of a ``seqpar train`` run: torch.distributed.checkpoint, written so a crash never
leaves a half-written one where a resume would look.

Layout under ``<save_dir>/checkpoints/``::

    step_00000200/          complete: model + optimizer (DCP, sharded when FSDP is on),
      .metadata, *.distcp     trainer.pt (scheduler, step, options), rng_rank<r>.pt (per rank),
      config.json, tokenizer/ the model's transformers config and the run's tokenizer (seqpar export)
    .tmp-step_00000300/     being written; renamed to step_00000300 only once every rank is done

The rename is the commit point: a directory named ``step_*`` is always complete, so Ctrl-C or a
dying worker at any moment leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_STEP_DIR = re.compile(r"^step_(\d{8})$")
TRAINER_FILE = "trainer.pt"
TOKENIZER_DIR = "tokenizer"


def checkpoint_root(save_dir: str) -> str:
    return os.path.join(save_dir, "checkpoints")


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(save_dir), f"step_{step:08d}")


def complete_checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint, oldest first."""
    root = checkpoint_root(save_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, TRAINER_FILE)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


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
                    tokenizer: Any = None) -> str:
    """Save on every rank (a collective); returns the committed directory. Keeps the ``keep``
    latest complete checkpoints. ``model_config`` (a transformers config) and ``tokenizer`` are
    written beside the weights, so the checkpoint alone can be exported (:mod:`.export`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    final = step_dir(save_dir, step)
    tmp = os.path.join(checkpoint_root(save_dir), f".tmp-step_{step:08d}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        torch.save({**trainer_state, "step": step, "scheduler": scheduler.state_dict()},
                   os.path.join(tmp, TRAINER_FILE))
        if model_config is not None:
            model_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(tmp, TOKENIZER_DIR))
        shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step (resumed run)
        os.rename(tmp, final)  # the commit point
        for _, old in complete_checkpoints(save_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def read_trainer_state(path: str) -> dict[str, Any]:
    """The small metadata file of a complete checkpoint (step, options, scheduler)."""
    return torch.load(os.path.join(path, TRAINER_FILE), weights_only=False)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG (a collective); returns the trainer
    state (``step`` and the options the run was started with)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer = read_trainer_state(path)
    scheduler.load_state_dict(trainer["scheduler"])
    rng = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if os.path.isfile(rng):
        _set_rng_state(torch.load(rng, weights_only=False))
    return trainer


def load_model_weights(path: str, model: nn.Module) -> nn.Module:
    """Load a checkpoint's weights into a plain (unsharded) ``model`` in a single process -- no
    process group needed; e.g. to evaluate or export a trained model."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": single process is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state["model"])
    return model
