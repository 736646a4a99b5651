"""Rectified flow, the objective SD3, Flux and Wan train with, on whole or sharded outputs.

A sample interpolates data and noise along a straight line, and the model predicts its velocity::

    t ~ logit-normal                 (sigmoid of a normal: most weight mid-way, as SD3 samples it)
    x_t = (1 - t) * x0 + t * noise   (noisy_latents)
    v   = noise - x0                 (velocity_target: d x_t / d t)
    loss = mean over every element of  w_b * (model(x_t, t) - v)^2     (flow_matching_loss)

With a parallelized model called ``output="sharded"``, each sp rank holds its own tokens of the
prediction (``[B, N_local, C']``) and cuts the target the same way
(:func:`seqpar.integrations.diffusers.shard_output`); :func:`flow_matching_loss` then adds the ranks'
sums in one all-reduce (with the count of elements, so uneven shards weigh right) and returns the
exact global mean on every rank, while its gradient stays local, pre-scaled by the sp size for
the average :func:`seqpar.sync_gradients` (or DDP / FSDP2) takes -- seqpar's gradient rule. With the
drop-in call (whole outputs) or no mesh it is the plain mean.

:func:`euler_sample` integrates the learned velocity from noise (t = 1) to data (t = 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ...comm import backward_faults, collectives, faults
from ...comm.guard import check_failures, pending_failure
from ...comm.mesh import Axis, as_mesh, axis_group


def logit_normal_timesteps(batch: int, *, mean: float = 0.0, std: float = 1.0, generator: torch.Generator | None = None,
                           device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """``[batch]`` timesteps in (0, 1): ``sigmoid(mean + std * N(0, 1))`` (SD3's logit-normal
    sampling). Seed ``generator`` alike on every sp rank: they must draw the same timesteps."""
    if std <= 0:
        raise ValueError(f"std={std}: the logit-normal's spread must be positive")
    z = torch.randn(batch, generator=generator, dtype=torch.float64, device=device)
    return torch.sigmoid(mean + std * z).to(dtype)


def _per_sample(t: Tensor, like: Tensor) -> Tensor:
    if t.dim() != 1 or t.shape[0] != like.shape[0]:
        raise ValueError(f"t must be [batch] = [{like.shape[0]}] timesteps, got {list(t.shape)}")
    return t.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))


def noisy_latents(x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """``(1 - t) * x0 + t * noise`` with ``t [B]`` broadcast over each sample (``x0``, ``noise``: the
    same shape)."""
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {list(x0.shape)} and noise {list(noise.shape)} must have the same shape")
    tb = _per_sample(t, x0)
    return (1 - tb) * x0 + tb * noise


def velocity_target(x0: Tensor, noise: Tensor) -> Tensor:
    """The rectified-flow target ``v = noise - x0``."""
    return noise - x0


class _GlobalMean(torch.autograd.Function):
    """Forward: all-reduce (sum) ``[local sum, local element count, failed]`` over the sp group and
    return the global mean (the batch's deferred attention failures ride the same collective). Backward:
    no collective -- ``grad * sp / count`` into this rank's sum: each rank answers for its own
    elements, and the average over the sp ranks taken afterwards adds them up."""

    @staticmethod
    def forward(ctx, local_sum: Tensor, count: float, group: dist.ProcessGroup) -> Tensor:
        failed = pending_failure()
        row = torch.stack([local_sum.detach().to(torch.float64), local_sum.new_tensor(count, dtype=torch.float64),
                           local_sum.new_tensor(failed or 0.0, dtype=torch.float64)])
        collectives.all_reduce(row, group=group)
        faults.raise_if_flagged()
        if failed is not None:
            check_failures(group, any_failed=bool(row[2].item()))
        if ctx.needs_input_grad[0]:
            backward_faults.loss_awaits_backward()
        total = float(row[1].item())
        ctx.scale = dist.get_world_size(group) / total
        return (row[0] / total).to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        backward_faults.backward_started()
        return grad * ctx.scale, None, None


def flow_matching_loss(pred: Tensor, target: Tensor, *, weights: Tensor | None = None,
                       mesh: DeviceMesh | None = None) -> Tensor:
    """The mean over every element of ``weights_b * (pred - target)^2`` (see the module doc).

    ``pred``, ``target``: the same shape, ``[B, ...]`` -- whole, or this rank's shard of a sharded
    call (``target`` cut by :func:`seqpar.integrations.diffusers.shard_output`). ``weights``: ``[B]``
    per-sample weights (SD3's loss weighting) or None. ``mesh``: with a sharded output, the mesh the
    model was parallelized over (the mean is then global, the gradient local, see the module doc);
    None for whole outputs. Computed in at least float32. Raises ValueError for mismatched shapes."""
    if pred.shape != target.shape:
        raise ValueError(f"pred {list(pred.shape)} and target {list(target.shape)} must have the same shape "
                         "(a sharded output: cut the target with seqpar.integrations.diffusers.shard_output)")
    dtype = torch.promote_types(pred.dtype, torch.float32)
    sq = (pred.to(dtype) - target.to(dtype)).square()
    if weights is not None:
        sq = sq * _per_sample(weights, sq)
    if mesh is None:
        return sq.mean()
    group = axis_group(as_mesh(mesh, "flow_matching_loss"), Axis.SP.value)
    return _GlobalMean.apply(sq.sum(), float(sq.numel()), group)


@torch.no_grad()
def euler_sample(velocity: Callable[[Tensor, Tensor], Tensor], noise: Tensor, *, steps: int,
                 shift: float = 1.0) -> Tensor:
    """Integrate ``dx/dt = velocity(x, t)`` from ``t = 1`` (``noise``) to ``t = 0`` in ``steps`` Euler
    steps and return ``x`` at 0. ``velocity(x [B, ...], t [B]) -> [B, ...]``: the model's prediction
    (a drop-in parallelized model called on the whole ``x``: every rank steps alike). ``shift``: the
    time shift of SD3 / Flux schedules, ``t' = shift t / (1 + (shift - 1) t)`` (1: uniform steps)."""
    if steps < 1:
        raise ValueError(f"steps={steps}: take at least one Euler step")
    if shift <= 0:
        raise ValueError(f"shift={shift} must be positive")
    ts = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    ts = shift * ts / (1 + (shift - 1) * ts)
    x = noise
    for i in range(steps):
        t = torch.full((noise.shape[0],), float(ts[i]), dtype=noise.dtype, device=noise.device)
        x = x + float(ts[i + 1] - ts[i]) * velocity(x, t)
    return x
