"""Mamba (S6): a causal convolution per inner channel, then the selective scan per channel. Jamba's
splits by inner channels (``"heads"``: the units are channels), with ``x_proj`` -- which reads
every channel to make dt, B and C -- summed across the ranks (:class:`SummedLinear`). Zamba's,
``MambaMixer`` and ``FalconMambaMixer`` (the last two only in attention-free models, which
parallelize refuses) run gathered. ``in_proj`` rows: ``[x (I) | z (I)]``."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor, nn

from ...comm.gather import all_reduce_sum
from .registry import GATHER, HEADS, STATE, MixerFamily, StateKernels, register_family
from .state_scans import MAMBA
from .views import conv_view, linear_view, plain, view_module


@dataclass(frozen=True)
class MambaChannels(MixerFamily):
    def units(self, module: nn.Module) -> int:
        return module.intermediate_size

    def split_fits(self, module: nn.Module, p: int) -> bool:
        """Plain bias-free projections (``dt_proj``'s bias and the convolution's are sliced), every
        rank some channels (``x_proj``'s all-reduce needs them all), ``A_log`` per channel."""
        return (type(module.conv1d) is nn.Conv1d and plain(module.in_proj, module.x_proj, module.out_proj)
                and type(module.dt_proj) is nn.Linear and module.intermediate_size >= p
                and tuple(module.A_log.shape) == (module.intermediate_size, module.ssm_state_size))

    def part(self, module: nn.Module, lo: int, hi: int, group: dist.ProcessGroup) -> nn.Module:
        """Inner channels ``lo .. hi``: ``in_proj`` rows ``[x | z]``, convolution channels,
        ``dt_proj`` rows, ``A_log`` / ``D`` and ``out_proj`` columns; each rank gets the whole dt,
        B, C from the summed ``x_proj`` (and runs the small dt / B / C norms on them)."""
        i_size, dt = module.intermediate_size, module.dt_proj
        return view_module(
            module, {"A_log": module.A_log[lo:hi], "D": module.D[lo:hi]}, intermediate_size=hi - lo,
            in_proj=linear_view(module.in_proj, (lo, hi), (i_size + lo, i_size + hi)),
            conv1d=conv_view(module.conv1d, (lo, hi)),
            x_proj=SummedLinear(module.x_proj.weight[:, lo:hi], group),
            dt_proj=view_module(dt, {"weight": dt.weight[lo:hi], "bias": None if dt.bias is None else dt.bias[lo:hi]}),
            out_proj=linear_view(module.out_proj, (lo, hi), columns=True))


class SummedLinear(nn.Module):
    """``x [..., channels of this rank] @ weight[:, those channels]^T``, summed over ``group``: a
    linear layer over channels spread across ranks (:func:`seqpar.comm.gather.all_reduce_sum`)."""

    def __init__(self, weight: Tensor, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight, self.group = weight, group

    def forward(self, x: Tensor) -> Tensor:
        return all_reduce_sum(nn.functional.linear(x, self.weight), group=self.group)


KERNELS = StateKernels("mamba_selective_scan", MAMBA)
register_family(MambaChannels("Mamba (Jamba)", ("JambaMambaMixer",), (STATE, HEADS, GATHER), KERNELS))
register_family(MixerFamily("Mamba (Zamba)", ("ZambaMambaMixer",), (STATE, GATHER), KERNELS))
register_family(MixerFamily("Mamba (gathered)", ("MambaMixer", "FalconMambaMixer"), (GATHER,)))
