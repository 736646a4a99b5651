"""Rectified flow as a training objective: ``seqpar train --objective flow-matching`` takes its loss here.

A DiT is called with whole inputs on every sp rank (seqpar.parallelize splits its sequences itself,
:mod:`seqpar.integrations.diffusers`), so unlike the token objectives of :mod:`.seam` the batch is
not sharded before the call. One unit is one sample; its noise and timestep are drawn from its own
``seed`` (the data source's: a pure function of the run's seed and the unit's index), so they are
the same on every sp rank, at any sp, micro-batch or resume::

    t_b      = sigmoid(mean + std * N(0, 1))                 logit-normal (SD3), from seed_b
    noise_b  = N(0, 1) of x0_b's shape                       from seed_b
    x_t      = (1 - t) x0 + t noise;  v = noise - x0
    pred     = model(x_t, scale * t, text)                   the sharded call: [B, N_local, C']
    loss     = sum_b w_b mean((pred_b - v_b)^2) / N_units    N_units: the step's samples, every dp rank

``w_b`` (``weighting``) is SD3's loss weighting (diffusers' ``compute_loss_weighting_for_sd3``):
"none" (1), "sigma_sqrt" (1 / t^2) or "cosmap" (2 / (pi (1 - 2t + 2t^2))). The per-shard mean is
:func:`~seqpar.integrations.diffusers.flow.flow_matching_loss` (one all-reduce over sp, its gradient
pre-scaled for the sp average); the dp share is pre-scaled for the dp average, as every objective's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..batch.loss import scale_grad
from ..comm.mesh import dp_size
from ..integrations.diffusers.catalog import trainable_of
from ..integrations.diffusers.flow import (
    euler_sample,
    flow_matching_loss,
    logit_normal_timesteps,
    noisy_latents,
    velocity_target,
)
from ..integrations.diffusers.parallelize import shard_output
from .seam import Needs, Objective, ObjectiveOutput, Takes

WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")
LATENTS, TEXT, SEED = "latents", "text_embeds", "seed"
"""A unit's columns: ``latents [C, F, H, W]``, ``text_embeds [L, D]`` and its noise ``seed``."""


def loss_weights(weighting: str, t: Tensor) -> Tensor | None:
    """SD3's per-sample loss weights at timesteps ``t`` (None for "none"); ValueError for an unknown
    scheme."""
    if weighting == "none":
        return None
    if weighting == "sigma_sqrt":
        return t ** -2.0
    if weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * t + 2 * t ** 2))
    raise ValueError(f"unknown flow weighting {weighting!r}: choose one of {list(WEIGHTINGS)}")


def draws(seeds: Sequence[int], shape: Sequence[int], *, mean: float, std: float, dtype: torch.dtype,
          device: torch.device) -> tuple[Tensor, Tensor]:
    """``(t [B], noise [B, *shape])`` of each sample from its own seed (see the module doc): the
    timestep first, then the noise, drawn in float32 whatever ``dtype`` (the same draws at any
    precision)."""
    ts, noises = [], []
    for seed in seeds:
        g = torch.Generator().manual_seed(int(seed))
        ts.append(logit_normal_timesteps(1, mean=mean, std=std, generator=g, dtype=torch.float64))
        noises.append(torch.randn(tuple(shape), generator=g, dtype=torch.float32))
    return torch.cat(ts).to(device, dtype), torch.stack(noises).to(device, dtype)


def _sample(out: Any) -> Tensor:
    return out[0] if isinstance(out, tuple) else out.sample


@dataclass
class FlowMatching(Objective):
    """Rectified flow on a parallelized diffusers DiT (see the module doc). ``weighting``: one of
    :data:`WEIGHTINGS`; ``mean``, ``std``: the logit-normal's."""

    weighting: str = "none"
    mean: float = 0.0
    std: float = 1.0

    name = "flow_matching"
    needs = Needs()
    takes = Takes()
    unit = "sample"

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"unknown flow weighting {self.weighting!r}: choose one of {list(WEIGHTINGS)}")
        if not self.std > 0:
            raise ValueError(f"the logit-normal's std must be > 0, got {self.std}")

    def __call__(self, model: nn.Module, local: dict[str, Any], mesh: DeviceMesh, *, reference: Any = None,
                 num_units: float | None = None, tile: int | None = None, **inputs: Tensor) -> ObjectiveOutput:
        """The loss of a whole batch (``local``: the same ``latents [B, C, F, H, W]``, ``text_embeds
        [B, L, D]``, ``seed [B]`` on every sp rank) on ``model`` parallelized with ``output="sharded"``:
        its share of the step's mean over ``num_units`` samples (None: the batch's own mean).
        ``reference``, ``tile``: not used (no reference, no vocabulary)."""
        missing = [k for k in (LATENTS, TEXT, SEED) if k not in local]
        if missing or reference is not None:
            raise ValueError(f"flow matching takes {LATENTS}, {TEXT} and {SEED} (no reference); missing {missing}")
        param = next(model.parameters())
        x0 = local[LATENTS].to(param.device, param.dtype)  # [B, C, F, H, W]
        text = local[TEXT].to(param.device, param.dtype)  # [B, L, D]
        b = x0.shape[0]
        t, noise = draws(local[SEED].reshape(-1).tolist(), x0.shape[1:], mean=self.mean, std=self.std,
                         dtype=x0.dtype, device=x0.device)
        scale = trainable_of(model).timestep_scale
        pred = _sample(model(hidden_states=noisy_latents(x0, noise, t), timestep=t * scale,
                             encoder_hidden_states=text))  # [B, N_local, C']
        target = shard_output(model, velocity_target(x0, noise))  # [B, N_local, C']
        mean = flow_matching_loss(pred, target, weights=loss_weights(self.weighting, t), mesh=mesh)
        if num_units is None:
            return ObjectiveOutput(mean, {}, float(b))
        # mean * b: this dp rank's sum of per-sample losses (every sample has as many elements)
        loss = scale_grad(mean * (b / float(num_units)), dp_size(mesh))  # the dp average of the shares
        return ObjectiveOutput(loss, {}, float(b))


@torch.no_grad()
def sample_latents(model: nn.Module, text: Tensor, noise: Tensor, *, steps: int) -> Tensor:
    """Latents ``[B, C, F, H, W]`` the flow of ``model`` (a drop-in call: parallelized with
    ``output="whole"``, or plain) carries ``noise`` to under the text embeddings ``text [B, L, D]``,
    in ``steps`` Euler steps (:func:`~seqpar.integrations.diffusers.flow.euler_sample`). Every sp rank
    passes the same inputs and gets the same latents."""
    param = next(model.parameters())
    scale = trainable_of(model).timestep_scale
    text = text.to(param.device, param.dtype)

    def velocity(x: Tensor, t: Tensor) -> Tensor:
        return _sample(model(hidden_states=x, timestep=t * scale, encoder_hidden_states=text))

    return euler_sample(velocity, noise.to(param.device, param.dtype), steps=steps)
