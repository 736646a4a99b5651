"""Mamba2 (SSD): a causal convolution over ``x | B | C``, then the chunked scan per head, a gated
RMS norm per group and ``out_proj``. Bamba's, NemotronH's, Zamba2's and Granite hybrid's split by
heads (``"heads"``): in whole groups when there are two or more (B and C are per group, the norm
normalizes per group), or, with one group, by heads, the group's norm summed across the ranks
(:class:`SplitGatedNorm`; these four share that norm's code, read and tested). Falcon-H1's (muP
multipliers) and ``Mamba2Mixer`` (only in attention-free models, which parallelize refuses) run
gathered. Rows of ``in_proj`` and channels of the convolution::

    in_proj   [gate (I) | x (I) | B (G*N) | C (G*N) | dt (H)]
    conv1d             [x (I) | B (G*N) | C (G*N)]          I = H * head_dim, G groups, N state
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...comm.gather import all_reduce_sum
from .registry import GATHER, HEADS, STATE, MixerFamily, StateKernels, register_family
from .state_scans import MAMBA2
from .views import conv_view, linear_view, plain, view_module


@dataclass(frozen=True)
class Mamba2(MixerFamily):
    def units(self, module: nn.Module) -> int:
        return module.num_heads if module.n_groups == 1 else module.n_groups

    def split_fits(self, module: nn.Module, p: int) -> bool:
        """Plain bias-free projections (a convolution bias is sliced); whole groups (two or more),
        or, with one group, every rank at least one head (the norm's all-reduce needs every rank);
        the norm per group and the heads filling the inner size, as the slices assume."""
        g = module.n_groups
        return (type(module.conv1d) is nn.Conv1d and plain(getattr(module, "in_proj", None), module.out_proj)
                and (g >= 2 or module.num_heads >= p) and module.num_heads % g == 0
                and getattr(module.norm, "group_size", None) == module.intermediate_size // g
                and module.intermediate_size == module.num_heads * module.head_dim)

    def part(self, module: nn.Module, lo: int, hi: int, group: dist.ProcessGroup) -> nn.Module:
        return _one_group_heads(module, lo, hi, group) if module.n_groups == 1 else _groups(module, lo, hi)


def _view(module: nn.Module, heads: tuple[int, int], x: tuple[int, int], conv: list[tuple[int, int]],
          **attrs: Any) -> nn.Module:
    """The module restricted to ``heads``, their channels ``x`` (of the gate, the norm, out_proj)
    and the convolution channels ``conv`` (x, then B and C)."""
    i_size, g, n_state = module.intermediate_size, module.n_groups, module.ssm_state_size
    dt = i_size + (i_size + 2 * g * n_state)  # where dt's rows start in in_proj
    return view_module(
        module, {name: getattr(module, name)[heads[0]:heads[1]] for name in ("dt_bias", "A_log", "D")},
        num_heads=heads[1] - heads[0], intermediate_size=x[1] - x[0], conv_dim=sum(e - a for a, e in conv),
        in_proj=linear_view(module.in_proj, x, *((i_size + a, i_size + e) for a, e in conv),
                            (dt + heads[0], dt + heads[1])),
        conv1d=conv_view(module.conv1d, *conv), out_proj=linear_view(module.out_proj, x, columns=True), **attrs)


def _groups(module: nn.Module, lo: int, hi: int) -> nn.Module:
    """Groups ``lo .. hi`` and their heads: x channels, B and C of those groups, the norm's weight."""
    g, n_state, i_size = module.n_groups, module.ssm_state_size, module.intermediate_size
    per_group = module.num_heads // g
    width = per_group * module.head_dim  # channels of a group's heads
    x = (lo * width, hi * width)
    b = (i_size + lo * n_state, i_size + hi * n_state)
    c = (i_size + g * n_state + lo * n_state, i_size + g * n_state + hi * n_state)
    norm = module.norm
    return _view(module, (lo * per_group, hi * per_group), x, [x, b, c], n_groups=hi - lo,
                 norm=view_module(norm, {"weight": norm.weight[x[0]:x[1]]}))


def _one_group_heads(module: nn.Module, lo: int, hi: int, group: dist.ProcessGroup) -> nn.Module:
    """Heads ``lo .. hi`` of the one group: B and C (shared by every head) whole, the heads' x
    channels, and the group's gated norm across the ranks (:class:`SplitGatedNorm`). It runs as in
    eval (``training=False``): the fused training kernel would normalize over this rank's heads alone."""
    n_state, i_size, hd = module.ssm_state_size, module.intermediate_size, module.head_dim
    x = (lo * hd, hi * hd)
    norm = module.norm
    return _view(module, (lo, hi), x, [x, (i_size, i_size + 2 * n_state)], training=False,
                 norm=SplitGatedNorm(norm.weight[x[0]:x[1]], i_size, norm.variance_epsilon, group))


class SplitGatedNorm(nn.Module):
    """The Mamba2 gated RMS norm (``x * silu(gate)``, normalized over the group, times ``weight``)
    of a group whose channels are spread over the ranks of ``group``: each rank holds its heads'
    channels and the group's mean square is the sum over ranks of the local sums of squares
    (:func:`seqpar.comm.gather.all_reduce_sum`: its backward all-reduces the gradient)."""

    def __init__(self, weight: Tensor, size: int, eps: float, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight, self.size, self.variance_epsilon, self.group = weight, size, eps, group

    def forward(self, hidden_states: Tensor, gate: Tensor | None = None) -> Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)  # [..., channels of this rank's heads]
        if gate is not None:
            h = h * nn.functional.silu(gate.to(torch.float32))
        square = all_reduce_sum(h.pow(2).sum(-1, keepdim=True), group=self.group)  # [..., 1], the whole group's
        h = h * torch.rsqrt(square / self.size + self.variance_epsilon)
        return self.weight * h.to(dtype)


KERNELS = StateKernels("mamba2_chunk_scan", MAMBA2, fused=("mamba2_split_conv1d_scan_combined",))
register_family(Mamba2("Mamba2", ("BambaMixer", "NemotronHMamba2Mixer", "Zamba2MambaMixer",
                                  "GraniteMoeHybridMambaLayer"), (STATE, HEADS, GATHER), KERNELS))
register_family(MixerFamily("Mamba2 (Falcon-H1)", ("FalconH1Mixer",), (STATE, GATHER), KERNELS))
register_family(MixerFamily("Mamba2 (gathered)", ("Mamba2Mixer",), (GATHER,)))
