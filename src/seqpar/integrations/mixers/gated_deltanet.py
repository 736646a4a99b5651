"""Gated DeltaNet: a causal convolution over ``[q | k | v]`` channels, then the chunked gated delta
rule per head. Qwen3-Next's and Qwen3.5's split by key heads (``"heads"``): each key head serves
``r = num_v_heads / num_k_heads`` consecutive value heads, and the heads are independent up to
``out_proj``. OLMo hybrid's runs gathered. Channels of the convolution::

    [q (nk*hk) | k (nk*hk) | v (nv*hv)]          a rank's key heads lo .. hi: three ranges of it
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from .registry import GATHER, HEADS, STATE, MixerFamily, StateKernels, register_family
from .state_scans import DELTA_RULE
from .views import conv_view, linear_view, plain, view_module


@dataclass(frozen=True)
class GatedDeltaNet(MixerFamily):
    """Split by key heads; ``projections`` names the input projections the class has (besides
    ``out_proj``), sliced by :meth:`_project`."""

    projections: tuple[str, ...] = ()

    def units(self, module: nn.Module) -> int:
        return module.num_k_heads

    def split_fits(self, module: nn.Module, p: int) -> bool:
        """Plain bias-free projections (a convolution bias is sliced) and whole value-head groups
        per key head."""
        lins = [getattr(module, name, None) for name in (*self.projections, "out_proj")]
        return (type(module.conv1d) is nn.Conv1d and plain(*lins)
                and module.num_v_heads % module.num_k_heads == 0)

    def part(self, module: nn.Module, lo: int, hi: int, group: dist.ProcessGroup) -> nn.Module:
        """The module restricted to key heads ``lo .. hi`` and their value heads."""
        nk, nv, hk, hv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
        r, n, kd = nv // nk, hi - lo, nk * hk
        qkv = ((lo * hk, hi * hk), (kd + lo * hk, kd + hi * hk), (2 * kd + lo * r * hv, 2 * kd + hi * r * hv))
        v = (lo * r * hv, hi * r * hv)  # the value heads' channels
        return view_module(module, {"dt_bias": module.dt_bias[lo * r:hi * r], "A_log": module.A_log[lo * r:hi * r]},
                           num_k_heads=n, num_v_heads=n * r, key_dim=n * hk, value_dim=n * r * hv,
                           conv_dim=2 * n * hk + n * r * hv, conv1d=conv_view(module.conv1d, *qkv),
                           out_proj=linear_view(module.out_proj, v, columns=True),
                           **self._project(module, lo, hi, qkv))

    def _project(self, module: nn.Module, lo: int, hi: int, qkv: tuple[tuple[int, int], ...]) -> dict[str, nn.Module]:
        raise NotImplementedError


@dataclass(frozen=True)
class Qwen3NextProjections(GatedDeltaNet):
    """``in_proj_qkvz`` rows grouped per key head (``2 hk + 2 r hv`` each), ``in_proj_ba`` too (``2 r``)."""

    def _project(self, module: nn.Module, lo: int, hi: int, qkv: tuple[tuple[int, int], ...]) -> dict[str, nn.Module]:
        hk, hv, r = module.head_k_dim, module.head_v_dim, module.num_v_heads // module.num_k_heads
        per = 2 * hk + 2 * r * hv
        return {"in_proj_qkvz": linear_view(module.in_proj_qkvz, (lo * per, hi * per)),
                "in_proj_ba": linear_view(module.in_proj_ba, (lo * 2 * r, hi * 2 * r))}


@dataclass(frozen=True)
class Qwen3_5Projections(GatedDeltaNet):
    """``in_proj_qkv`` rows follow the convolution's channels; ``in_proj_z`` / ``_b`` / ``_a`` the
    value heads (``hv``, 1, 1 rows each)."""

    def _project(self, module: nn.Module, lo: int, hi: int, qkv: tuple[tuple[int, int], ...]) -> dict[str, nn.Module]:
        hv, r = module.head_v_dim, module.num_v_heads // module.num_k_heads
        out = {"in_proj_qkv": linear_view(module.in_proj_qkv, *qkv)}
        for name, width in (("in_proj_z", hv), ("in_proj_b", 1), ("in_proj_a", 1)):
            out[name] = linear_view(getattr(module, name), (lo * r * width, hi * r * width))
        return out


KERNELS = StateKernels("torch_chunk_gated_delta_rule", DELTA_RULE)
register_family(Qwen3NextProjections("Gated DeltaNet (Qwen3-Next)", ("Qwen3NextGatedDeltaNet",), (STATE, HEADS, GATHER),
                                     KERNELS, projections=("in_proj_qkvz", "in_proj_ba")))
register_family(Qwen3_5Projections("Gated DeltaNet (Qwen3.5)", ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"),
                                   (STATE, HEADS, GATHER), KERNELS,
                                   projections=("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")))
register_family(MixerFamily("Gated DeltaNet (OLMo hybrid)", ("OlmoHybridGatedDeltaNet",), (STATE, GATHER), KERNELS))
