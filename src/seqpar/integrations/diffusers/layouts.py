"""The token layout of a diffusers transformer's output: how the whole output (``sample``) is made of
the ``[B, N, C']`` tokens its last projection writes, so that a sharded call's output shard and a
target (``noise - x0``) can be compared token by token (:func:`seqpar.integrations.diffusers.shard_output`).

Each layout is the inverse of one model family's unpatchify, a pure permutation::

    "tokens"     [B, N, C]            as they are (Flux, Qwen-Image: the pipeline packs the latents)
    "patches2d"  [B, C, H, W]      -> [B, (H/p)(W/p), p*p*C], channels ordered (p_h, p_w, C)   (SD3)
    "patches3d"  [B, C, F, H, W]   -> [B, (F/pt)(H/ph)(W/pw), pt*ph*pw*C], ordered (pt, ph, pw, C)   (Wan)
    "patches2d_cpq"  [B, C, H, W]  -> [B, (H/p)(W/p), C*p*p], ordered (C, p_h, p_w)     (CogView 3 / 4)
    "frames_cpq"     [B, F, C, H, W] -> [B, F*(H/p)(W/p), C*p*p], frames first          (CogVideoX 1.0)
    "frames_cpq_t"   [B, F, C, H, W] -> [B, (F/pt)(H/p)(W/p), C*pt*p*p]                 (CogVideoX 1.5)
    "cosmos"     [B, C, F, H, W]   -> [B, (F/pt)(H/ph)(W/pw), ph*pw*pt*C]                    (Cosmos)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor


def _size(value: Any, n: int) -> tuple[int, ...]:
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),) * n


def tokens(_config: Any, x: Tensor) -> Tensor:
    """``[B, N, C]`` as it is."""
    return x


def patches2d(config: Any, x: Tensor) -> Tensor:
    """``[B, C, H, W] -> [B, (H/p)(W/p), p*p*C]`` (SD3's unpatchify, inverted)."""
    p, q = _size(config.patch_size, 2)
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // q, q).permute(0, 2, 4, 3, 5, 1)  # [B, h, w, p, q, C]
    return x.reshape(b, (h // p) * (w // q), p * q * c)


def patches3d(config: Any, x: Tensor) -> Tensor:
    """``[B, C, F, H, W] -> [B, (F/pt)(H/ph)(W/pw), pt*ph*pw*C]`` (Wan's unpatchify, inverted)."""
    pt, ph, pw = _size(config.patch_size, 3)
    b, c, f, h, w = x.shape
    x = x.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 3, 5, 7, 1)
    return x.reshape(b, (f // pt) * (h // ph) * (w // pw), pt * ph * pw * c)  # [B, f, h, w, pt, ph, pw, C]


def patches2d_cpq(config: Any, x: Tensor) -> Tensor:
    """``[B, C, H, W] -> [B, (H/p)(W/p), C*p*p]`` (CogView's unpatchify, inverted)."""
    p = int(config.patch_size)
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)  # [B, h, w, C, p, q]
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def frames_cpq(config: Any, x: Tensor) -> Tensor:
    """``[B, F, C, H, W] -> [B, F*(H/p)(W/p), C*p*p]`` (CogVideoX 1.0, frames first), or with a
    temporal patch ``pt`` (1.5) ``-> [B, (F/pt)(H/p)(W/p), C*pt*p*p]``."""
    p, pt = int(config.patch_size), getattr(config, "patch_size_t", None)
    b, f, c, h, w = x.shape
    if pt is None:
        x = x.reshape(b, f, c, h // p, p, w // p, p).permute(0, 1, 3, 5, 2, 4, 6)  # [B, F, h, w, C, p, q]
        return x.reshape(b, f * (h // p) * (w // p), c * p * p)
    x = x.reshape(b, f // pt, pt, c, h // p, p, w // p, p).permute(0, 1, 4, 6, 3, 2, 5, 7)  # [B, f, h, w, C, pt, p, q]
    return x.reshape(b, (f // pt) * (h // p) * (w // p), c * pt * p * p)


def cosmos(config: Any, x: Tensor) -> Tensor:
    """``[B, C, F, H, W] -> [B, (F/pt)(H/ph)(W/pw), ph*pw*pt*C]`` (Cosmos' unpatchify, inverted)."""
    pt, ph, pw = _size(config.patch_size, 3)
    b, c, f, h, w = x.shape
    x = x.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 5, 7, 3, 1)
    return x.reshape(b, (f // pt) * (h // ph) * (w // pw), ph * pw * pt * c)  # [B, f, h, w, ph, pw, pt, C]


LAYOUTS: dict[str, Callable[[Any, Tensor], Tensor]] = {"cosmos": cosmos,"tokens": tokens, "patches2d": patches2d,
                                                       "patches3d": patches3d, "patches2d_cpq": patches2d_cpq,
                                                       "frames_cpq": frames_cpq}
"""Each output layout's tokens-from-whole function, by name (a family names its layout)."""
