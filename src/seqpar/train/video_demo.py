"""The embedded data of ``seqpar train --objective flow-matching`` without --data: a square moving
across frames, and the picture of what the model learnt (``samples.png``).

Each clip is ``[3, F, H, W]`` RGB in [-1, 1] (the latents are the pixels: no VAE), 4 frames of 32 x 32
by default -- 1,024 tokens through tiny-wan's 1 x 2 x 2 patches. A clip has a black background and one
square of side ``H / 4`` in one of six colours, starting anywhere and moving by up to 3 pixels per frame
in x and y, staying inside the frame; all drawn per clip from the run's seed. Its "text" is 4 embedding
tokens of width 16 that say the clip: the colour (one-hot), the start and the velocity (Fourier
features), and a constant token. The training clips are an endless stream; the held-out ones
(--eval-rows) another.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .latent_data import LatentSource
from .sources import EVAL

PALETTE = torch.tensor([[1, -1, -1], [-1, 1, -1], [-1, -1, 1], [1, 1, -1], [1, -1, 1], [-1, 1, 1]],
                       dtype=torch.float32)
"""Red, green, blue, yellow, magenta, cyan (RGB in [-1, 1])."""
TEXT_LEN, TEXT_DIM, MAX_SPEED = 4, 16, 3


def _fourier(values: Tensor, n: int = 4) -> Tensor:
    """``[k]`` numbers in [0, 1] -> ``[2 n k]`` features: sin and cos of pi j v, j = 1..n."""
    j = torch.arange(1, n + 1, dtype=torch.float32)
    angles = math.pi * values[:, None] * j  # [k, n]
    return torch.cat([angles.sin(), angles.cos()], dim=1).reshape(-1)


def describe_clip(colour: int, start: tuple[int, int], speed: tuple[int, int], size: int) -> Tensor:
    """The text embedding ``[TEXT_LEN, TEXT_DIM]`` of a clip (see the module doc)."""
    text = torch.zeros(TEXT_LEN, TEXT_DIM)
    text[0, colour] = 1.0
    text[1] = _fourier(torch.tensor(start, dtype=torch.float32) / size)
    text[2] = _fourier((torch.tensor(speed, dtype=torch.float32) + MAX_SPEED) / (2 * MAX_SPEED))
    text[3, 0] = 1.0
    return text


def render(colour: int, start: tuple[int, int], speed: tuple[int, int], *, frames: int, size: int) -> Tensor:
    """The clip ``[3, frames, size, size]``: the square's top-left corner at ``start + f * speed``."""
    side = size // 4
    clip = -torch.ones(3, frames, size, size)
    for f in range(frames):
        x, y = start[0] + f * speed[0], start[1] + f * speed[1]
        clip[:, f, y:y + side, x:x + side] = PALETTE[colour][:, None, None]
    return clip


class MovingSquares(LatentSource):
    """The embedded clips (see the module doc): a :class:`~.sources.DataSource` of endless training
    clips and ``eval_rows`` held-out ones."""

    def __init__(self, seed: int, eval_rows: int, *, frames: int = 4, size: int = 32) -> None:
        if size % 4 or size // 4 + (frames - 1) * MAX_SPEED > size:
            raise ValueError(f"a {size} x {size} frame cannot hold the square's path over {frames} frames")
        super().__init__(seed, None, eval_rows)
        self.frames, self.size = frames, size

    def clip(self, i: int, split: int) -> tuple[int, tuple[int, int], tuple[int, int]]:
        """``(colour, start, speed)`` of clip ``i`` of ``split``."""
        g = torch.Generator().manual_seed(self.seed * 7_919 + 2 * i + (1 if split == EVAL else 0))
        colour = int(torch.randint(len(PALETTE), (1,), generator=g))
        speed = tuple(int(v) for v in torch.randint(-MAX_SPEED, MAX_SPEED + 1, (2,), generator=g))
        room = self.size - self.size // 4
        start = []
        for v in speed:  # the corner stays in [0, room] on every frame
            lo, hi = max(0, -v * (self.frames - 1)), room - max(0, v * (self.frames - 1))
            start.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
        return colour, (start[0], start[1]), (speed[0], speed[1])

    def sample(self, i: int, split: int) -> tuple[Tensor, Tensor]:
        colour, start, speed = self.clip(i, split)
        return (render(colour, start, speed, frames=self.frames, size=self.size),
                describe_clip(colour, start, speed, self.size))

    def describe(self) -> str:
        tokens = self.frames * (self.size // 2) ** 2
        return (f"the embedded moving squares: clips of {self.frames} RGB frames of {self.size} x {self.size} "
                f"({tokens:,} tokens through 1 x 2 x 2 patches), a square of one of {len(PALETTE)} colours moving "
                f"in a straight line, text embeddings [{TEXT_LEN}, {TEXT_DIM}] that describe it; {self.n_eval} "
                "held-out clips")


def save_frame_grid(path: str, rows: list[tuple[str, Tensor]]) -> str:
    """A picture of clips: one row per ``(label, clip [C, F, H, W])`` (the first 3 channels shown as RGB,
    values in [-1, 1], clipped), one column per frame. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = max(clip.shape[1] for _, clip in rows)
    fig, axes = plt.subplots(len(rows), frames, figsize=(1.3 * frames + 1.4, 1.3 * len(rows)), squeeze=False)
    for r, (label, clip) in enumerate(rows):
        rgb = ((clip[:3].float().clamp(-1, 1) + 1) / 2).permute(1, 2, 3, 0)  # [F, H, W, 3]
        for f in range(frames):
            ax = axes[r][f]
            ax.set_xticks([])
            ax.set_yticks([])
            if f < rgb.shape[0]:
                ax.imshow(rgb[f].numpy(), interpolation="nearest")
            if r == 0:
                ax.set_title(f"frame {f}", fontsize=8)
        axes[r][0].set_ylabel(label, fontsize=7, rotation=0, ha="right", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
