"""The embedded data of ``seqpar train --objective flow-matching`` without --data: a square moving
across frames, and the picture of what the model learnt (``samples.png``).

Each clip is ``[3, F, H, W]`` RGB in [-1, 1] (the latents are the pixels: no VAE), 16 frames of
32 x 32 by default -- 1,024 tokens through tiny-wan's 1 x 4 x 4 patches. A clip has a black background
and one square of 2 x 2 cells (a cell: a patch, 4 pixels) in one of six colours, starting at any cell
and moving one cell per frame in one of 9 ways (standing still too), bouncing off the edges; all drawn
per clip from the run's seed. Its "text" is 3 embedding tokens of width 16 that say the colour and the
move (one-hot) and a constant token. The training clips are an endless stream; the held-out ones
(--eval-rows) another.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .latent_data import LatentSource
from .sources import EVAL

PALETTE = torch.tensor([[1, -1, -1], [-1, 1, -1], [-1, -1, 1], [1, 1, -1], [1, -1, 1], [-1, 1, 1]],
                       dtype=torch.float32)
"""Red, green, blue, yellow, magenta, cyan (RGB in [-1, 1])."""
SPEEDS = [(dx, dy) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
"""The square's moves per frame, in cells (x, y)."""
TEXT_LEN, TEXT_DIM = 3, 16


def describe_clip(colour: int, speed: tuple[int, int]) -> Tensor:
    """The text embedding ``[TEXT_LEN, TEXT_DIM]`` of a clip: its colour and its move (one-hot), and a
    constant token. (Not its start: a DiT's positions are relative -- RoPE -- so where the square
    starts is the sampler's to choose.)"""
    text = torch.zeros(TEXT_LEN, TEXT_DIM)
    text[0, colour] = 1.0
    text[1, SPEEDS.index(speed)] = 1.0
    text[2, 0] = 1.0
    return text


def path(start: tuple[int, int], speed: tuple[int, int], frames: int, room: int) -> list[tuple[int, int]]:
    """The square's cell on each frame: ``start`` moved by ``speed`` per frame, bouncing off the edges
    (cells 0 .. ``room``)."""
    out, (x, y), (dx, dy) = [], start, speed
    for _ in range(frames):
        out.append((x, y))
        if not 0 <= x + dx <= room:
            dx = -dx
        if not 0 <= y + dy <= room:
            dy = -dy
        x, y = x + dx, y + dy
    return out


def render(colour: int, start: tuple[int, int], speed: tuple[int, int], *, frames: int, size: int,
           cell: int, side: int) -> Tensor:
    """The clip ``[3, frames, size, size]``: a square of ``side`` x ``side`` cells (``cell`` pixels each)
    on black."""
    clip = -torch.ones(3, frames, size, size)
    for f, (x, y) in enumerate(path(start, speed, frames, size // cell - side)):
        clip[:, f, y * cell:(y + side) * cell, x * cell:(x + side) * cell] = PALETTE[colour][:, None, None]
    return clip


class MovingSquares(LatentSource):
    """The embedded clips (see the module doc): a :class:`~.sources.DataSource` of endless training
    clips and ``eval_rows`` held-out ones."""

    def __init__(self, seed: int, eval_rows: int, *, frames: int = 16, size: int = 32, cell: int = 4,
                 side: int = 2) -> None:
        if size % cell or size // cell < side + 1:
            raise ValueError(f"a {size} x {size} frame of {cell}-pixel cells cannot hold a moving square of {side} "
                             "cells")
        super().__init__(seed, None, eval_rows)
        self.frames, self.size, self.cell, self.side = frames, size, cell, side

    def clip(self, i: int, split: int) -> tuple[int, tuple[int, int], tuple[int, int]]:
        """``(colour, start cell, speed)`` of clip ``i`` of ``split``."""
        g = torch.Generator().manual_seed(self.seed * 7_919 + 2 * i + (1 if split == EVAL else 0))
        colour = int(torch.randint(len(PALETTE), (1,), generator=g))
        speed = SPEEDS[int(torch.randint(len(SPEEDS), (1,), generator=g))]
        x, y = (int(v) for v in torch.randint(0, self.size // self.cell - self.side + 1, (2,), generator=g))
        return colour, (x, y), speed

    def sample(self, i: int, split: int) -> tuple[Tensor, Tensor]:
        colour, start, speed = self.clip(i, split)
        return (render(colour, start, speed, frames=self.frames, size=self.size, cell=self.cell, side=self.side),
                describe_clip(colour, speed))

    def describe(self) -> str:
        tokens = self.frames * (self.size // self.cell) ** 2
        return (f"the embedded moving squares: clips of {self.frames} RGB frames of {self.size} x {self.size} "
                f"({tokens:,} tokens through 1 x {self.cell} x {self.cell} patches), a square of one of "
                f"{len(PALETTE)} colours moving one way and bouncing off the edges, text embeddings "
                f"[{TEXT_LEN}, {TEXT_DIM}] that say its colour and move; {self.n_eval} held-out clips")


def save_frame_grid(path: str, rows: list[tuple[str, Tensor]]) -> str:
    """A picture of clips: one row per ``(label, clip [C, F, H, W])`` (the first 3 channels shown as RGB,
    values in [-1, 1], clipped), one column per frame. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = max(clip.shape[1] for _, clip in rows)
    fig, axes = plt.subplots(len(rows), frames, figsize=(0.8 * frames + 1.4, 0.8 * len(rows) + 0.3), squeeze=False)
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
