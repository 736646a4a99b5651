"""What the pieces of one rank's ``seqpar train`` run share: :class:`RunContext`, frozen once the model
has its weights. The step, the dynamic schedule and the evaluation take it instead of a trainer
object, so what each reads is in its signature::

    job         the options and everything decided before any process (sp, dp, strategy, layout, data)
    mesh        the dp x sp (x tp, ep folded) device mesh; rank, dp_rank, sp_rank, tp_rank: this
                process's place in it
    device      this rank's device
    model       the parallelized (and, under FSDP2, sharded) transformers model
    policy      what the objective runs: the peft model around ``model`` (LoRA), or ``model``
    reference   reference log-probs (a preference objective): a frozen copy of the initial model,
                ``ADAPTERS_OFF`` (the policy with its LoRA adapters off), or None
    use_fsdp    whether ``model`` is sharded by FSDP2 (its gradients reduce-scatter in backward)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from seqpar.comm.mesh import default_device_type

from .job import Job


@dataclass(frozen=True)
class RunContext:
    """One rank's run, as every piece of it sees it (see the module doc)."""

    job: Job
    mesh: DeviceMesh
    device: torch.device
    rank: int
    dp_rank: int
    sp_rank: int
    model: nn.Module
    policy: nn.Module
    reference: nn.Module | str | None
    use_fsdp: bool
    tp_rank: int = 0


def rank_device() -> torch.device:
    """This rank's device: its CUDA device (``LOCAL_RANK``) when the process group runs NCCL, else the CPU."""
    if torch.cuda.is_available() and default_device_type() == "cuda":  # NCCL among the group's backends
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")
