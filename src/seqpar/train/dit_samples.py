"""The end of a ``seqpar train --objective flow-matching`` run (with --plot): what the DiT draws from the
first held-out clips' text, beside those clips, in ``samples.png`` -- so the result can be seen."""

from __future__ import annotations

import os
from typing import Any

import torch

import seqpar
from seqpar.objectives.flow_matching import LATENTS, TEXT, sample_latents

from .sources import EVAL, TRAIN, DataSource, stack
from .video_demo import save_frame_grid

SAMPLES_FILE = "samples.png"
SAMPLE_CLIPS, SAMPLE_STEPS = 4, 30


def save_samples(ctx: Any, data: DataSource) -> str:
    """Every rank of the run (``ctx``: its :class:`~seqpar.train.context.RunContext`): the model made a
    drop-in (``output="whole"``: every sp rank steps alike), ``SAMPLE_CLIPS`` clips sampled from the first
    held-out units' text (the training ones without held-out units; noise from --seed) in
    ``SAMPLE_STEPS`` Euler steps, and rank 0 draws each under its clip in ``samples.png``. Returns its
    path (on every rank). The model is left parallelized for whole outputs: nothing trains after this."""
    cfg, model = ctx.job.cfg, ctx.model
    split, n = (EVAL, data.n_eval) if data.n_eval else (TRAIN, SAMPLE_CLIPS)
    batch = stack([data.row(i, split) for i in range(min(n, SAMPLE_CLIPS))])
    seqpar.unparallelize(model)
    seqpar.parallelize(model, ctx.mesh, strategy=ctx.job.strategy, output="whole")
    noise = torch.randn(batch[LATENTS].shape, generator=torch.Generator().manual_seed(cfg.seed), dtype=torch.float32)
    model.eval()
    clips = sample_latents(model, batch[TEXT], noise, steps=SAMPLE_STEPS).float().cpu()
    model.train()
    path = os.path.abspath(os.path.join(cfg.save_dir, SAMPLES_FILE))
    if ctx.rank == 0:
        which = "held-out" if split == EVAL else "training"
        rows = []
        for i, clip in enumerate(clips):
            rows += [(f"{which} {i}", batch[LATENTS][i]), (f"sampled {i}", clip)]
        save_frame_grid(path, rows)
    return path
