"""LFM2's short convolution: ``in_proj`` per token, a causal depthwise convolution of ``L_cache``
taps, ``out_proj`` per token. It runs with a halo of the previous rank's last ``L_cache - 1``
inputs (``"halo"``), gathered where the halo does not fit (a permuted layout, short shards)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .registry import GATHER, HALO, MixerFamily, register_family


@dataclass(frozen=True)
class ShortConv(MixerFamily):
    def halo_width(self, module: nn.Module) -> int:
        """``k - 1`` for the module's causal convolution ``conv`` of width ``k``; -1 (no halo) when
        ``conv`` is not a plain ``nn.Conv1d``."""
        conv = getattr(module, "conv", None)
        return int(conv.kernel_size[0]) - 1 if isinstance(conv, nn.Conv1d) else -1


register_family(ShortConv("short convolution (LFM2)", ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"),
                          (HALO, GATHER)))
