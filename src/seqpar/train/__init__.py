"""``seqpar train``: long-sequence training with sequence parallelism, from one command or from Python.

    from seqpar.train import TrainConfig, train
    summary = train(TrainConfig(seq_len=4096, sp=2, steps=300))   # local gloo workers

Inside your own process group (torchrun), ``run_training(prepare_job(cfg, world))`` on every rank.
What ``--objective`` can train is one registry, :data:`seqpar.train.objectives.OBJECTIVES`.
"""

from __future__ import annotations

from typing import Any

from .config import TrainConfig
from .demo_data import CopyTask
from .job import Job, prepare_job
from .loop import Run, RunSummary, run_training, start_run
from .objectives import OBJECTIVES


def train(cfg: TrainConfig | None = None, **options: Any) -> RunSummary:
    """Run a training job on local worker processes (gloo); returns rank 0's summary.

    ``options`` override fields of ``cfg`` (or of the defaults). Raises ValueError for bad options
    or data, :class:`seqpar.train.launcher.JobFailed` if a worker dies or hangs."""
    from .launcher import run_local

    cfg = (cfg or TrainConfig()).replace(**options)
    return run_local(prepare_job(cfg))


__all__ = ["OBJECTIVES", "CopyTask", "Job", "Run", "RunSummary", "TrainConfig", "prepare_job", "run_training",
           "start_run", "train"]
