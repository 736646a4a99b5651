"""Kimi delta attention (a per-channel decay): a causal convolution over ``[q | k | v]``, then the
chunked delta rule per head. Kimi Linear's splits by heads (``"heads"``); Bailing hybrid's runs
gathered. A rank's heads ``lo .. hi`` are the channels ``lo * head_dim .. hi * head_dim`` of each
of q, k, v, the gates and the decays."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from .registry import GATHER, HEADS, STATE, MixerFamily, StateKernels, register_family
from .state_scans import DELTA_RULE
from .views import conv_view, linear_view, plain, view_module

_LINEAR = ("q_proj", "k_proj", "v_proj", "b_proj", "g_b_proj", "o_proj")


@dataclass(frozen=True)
class KimiDeltaAttention(MixerFamily):
    def units(self, module: nn.Module) -> int:
        return module.num_heads

    def split_fits(self, module: nn.Module, p: int) -> bool:
        """Plain bias-free projections and convolution, one decay per head in ``A_log``."""
        gate = module.forget_gate
        a_log = getattr(gate, "A_log", None)
        return (plain(module.conv1d, *(getattr(module, n, None) for n in _LINEAR), getattr(gate, "f_b_proj", None))
                and a_log is not None and tuple(a_log.shape) == (1, 1, module.num_heads, 1))

    def part(self, module: nn.Module, lo: int, hi: int, group: dist.ProcessGroup) -> nn.Module:
        """Heads ``lo .. hi``: q / k / v / b / gate rows and convolution channels of those heads,
        their per-channel decays (the forget gate's ``f_b_proj`` rows, ``dt_bias``, ``A_log``) and
        ``o_proj`` columns. The low-rank ``f_a_proj`` / ``g_a_proj`` feed every head: each rank
        runs them whole (their gradients add up over ranks)."""
        d, dim, n = module.head_dim, module.qkv_dim, hi - lo
        ch = (lo * d, hi * d)
        gate = module.forget_gate
        return view_module(
            module, {}, num_heads=n, qkv_dim=n * d, conv_dim=3 * n * d,
            **{name: linear_view(getattr(module, name), ch) for name in ("q_proj", "k_proj", "v_proj", "g_b_proj")},
            b_proj=linear_view(module.b_proj, (lo, hi)),
            conv1d=conv_view(module.conv1d, *((ch[0] + i * dim, ch[1] + i * dim) for i in range(3))),
            forget_gate=view_module(gate, {"dt_bias": gate.dt_bias[ch[0]:ch[1]], "A_log": gate.A_log[:, :, lo:hi]},
                                    num_heads=n, qkv_dim=n * d, f_b_proj=linear_view(gate.f_b_proj, ch)),
            o_proj=linear_view(module.o_proj, ch, columns=True))


KERNELS = StateKernels("chunk_kimi_delta_attention", DELTA_RULE)
register_family(KimiDeltaAttention("Kimi delta attention", ("KimiLinearDeltaAttention",), (STATE, HEADS, GATHER),
                                   KERNELS))
register_family(MixerFamily("Kimi delta attention (Bailing hybrid)", ("BailingHybridDeltaAttention",), (STATE, GATHER),
                            KERNELS))
