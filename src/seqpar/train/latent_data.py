"""Data of ``seqpar train --objective flow-matching``: precomputed latents and text embeddings, one
sample per row (docs/guides/diffusers.md, "Training")::

    file         holds
    *.safetensors  tensors "latents" [N, C, F, H, W] and "text_embeds" [N, L, D] (floating)
    *.npz          the same two arrays (numpy.load(allow_pickle=False): an object array is refused)
    *.parquet      one row per sample: "latents" and "text_embeds" (lists of floats: the sample's
                   values flattened in C order) with "latents_shape" [C, F, H, W] and
                   "text_embeds_shape" [L, D] (lists of ints)

Every sample of every file must have the same shapes (a batch stacks them). Anything else -- another
extension, a missing or extra key, a shape of another rank, rows that disagree -- is a ValueError
naming the file, the key (or row) and the shape. Nothing read runs code: safetensors, numpy without
pickle, parquet through pyarrow. Values are held as float32 (the run casts to its --dtype).

A unit (:class:`LatentSource`) is one sample ``{"latents": [1, C, F, H, W], "text_embeds": [1, L, D],
"seed": [1]}``: ``seed`` draws its noise and timestep (:mod:`seqpar.objectives.flow_matching`), a
pure function of the run's --seed and the unit's index in the run, so a resumed run draws what the
uninterrupted one would have.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor

from seqpar.objectives.flow_matching import LATENTS, SEED, TEXT

from .sources import EVAL, TRAIN

SHAPES = {LATENTS: ("N", "C", "F", "H", "W"), TEXT: ("N", "L", "D")}
"""Each array's dimensions in a .safetensors / .npz file (N: samples)."""
EXTS = (".safetensors", ".npz", ".parquet")
FORMATS_HELP = ("*.safetensors / *.npz: arrays 'latents' [N, C, F, H, W] and 'text_embeds' [N, L, D]; *.parquet: one "
                "row per sample, 'latents' / 'text_embeds' flattened with 'latents_shape' / 'text_embeds_shape'")
_EVAL_STREAM = 1 << 40  # held-out units draw their noise from seeds no training unit uses


def unit_seed(run_seed: int, index: int, split: int) -> int:
    """The noise seed of unit ``index`` of ``split``: a pure function of the run's seed."""
    return (run_seed * 1_000_003 + index + (_EVAL_STREAM if split == EVAL else 0)) % (1 << 62)


class LatentSource:
    """The source side of latent data (a :class:`~.sources.DataSource`): units of samples read by
    :meth:`sample`, the training split in a seeded order per epoch, the noise seeds (see the module
    doc). Subclasses give ``sample(i, split)`` and the split sizes."""

    vocab_size = 0
    max_token_id = -1  # no tokens
    chance = None
    rows_per_unit = 1

    def __init__(self, seed: int, n_train: int | None, n_eval: int) -> None:
        self.seed, self.n_train, self._n_eval = seed, n_train, n_eval
        self._order: tuple[int, list[int]] = (-1, [])

    @property
    def n_eval(self) -> int:
        return self._n_eval

    def sample(self, i: int, split: int) -> tuple[Tensor, Tensor]:
        """``(latents [C, F, H, W], text_embeds [L, D])`` of sample ``i`` of ``split``."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def row(self, index: int, split: int = TRAIN) -> dict[str, Tensor]:
        i = index
        if split == TRAIN and self.n_train is not None:  # a finite training set: an epoch-wise shuffle
            epoch, k = divmod(index, self.n_train)
            if self._order[0] != epoch:
                g = torch.Generator().manual_seed(self.seed * 100_003 + epoch + 1)
                self._order = (epoch, torch.randperm(self.n_train, generator=g).tolist())
            i = self._order[1][k]
        latents, text = self.sample(i, split)
        return {LATENTS: latents[None], TEXT: text[None],
                SEED: torch.tensor([unit_seed(self.seed, index, split)], dtype=torch.long)}

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``([C, F, H, W], [L, D])`` of every sample."""
        latents, text = self.sample(0, EVAL if self.n_eval else TRAIN)
        return tuple(latents.shape), tuple(text.shape)


class LatentFiles(LatentSource):
    """Samples read from --data files (see the module doc), ``eval_rows`` of them held out (at most a
    tenth), chosen by a seeded permutation."""

    def __init__(self, latents: Tensor, text: Tensor, *, seed: int, eval_rows: int, describe: str) -> None:
        n = latents.shape[0]
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        n_eval = min(eval_rows, n // 10)
        if n - n_eval < 1:
            raise ValueError("--data holds no sample to train on")
        self.eval_idx, self.train_idx = perm[:n_eval], perm[n_eval:]
        self.latents, self.text = latents, text
        super().__init__(seed, len(self.train_idx), n_eval)
        self._describe = describe + (f"; {n_eval} held out" if n_eval == eval_rows else
                                     f"; {n_eval} held out (--eval-rows {eval_rows} is capped at a tenth of {n})")

    def sample(self, i: int, split: int) -> tuple[Tensor, Tensor]:
        j = (self.eval_idx if split == EVAL else self.train_idx)[i]
        return self.latents[j], self.text[j]

    def describe(self) -> str:
        return self._describe


def _check_array(path: str, key: str, shape: Sequence[int], floating: bool) -> None:
    dims = SHAPES[key]
    if not floating:
        raise ValueError(f"{path}: {key!r} must hold floating-point values (its latents / embeddings)")
    if len(shape) != len(dims):
        raise ValueError(f"{path}: {key!r} has shape {list(shape)}, expected [{', '.join(dims)}] "
                         f"({len(dims)} dimensions, one sample per row)")


def _arrays(path: str) -> dict[str, Tensor]:
    """The two arrays of a .safetensors or .npz file, checked (see the module doc)."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                found = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 -- safe_open has no __iter__
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    else:
        import numpy as np

        try:
            with np.load(path, allow_pickle=False) as f:
                found = {k: f[k] for k in f.files}
        except ValueError as e:  # an object array needs pickle: refused
            raise ValueError(f"{path}: {e} (seqpar reads numeric arrays only, never pickled objects)") from None
        except (OSError, EOFError) as e:
            raise ValueError(f"{path}: not a readable .npz file ({e})") from None
        bad = [k for k, v in found.items() if not np.issubdtype(v.dtype, np.number)]
        if bad:
            raise ValueError(f"{path}: {bad[0]!r} holds {found[bad[0]].dtype} values, not numbers")
        found = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in found.items()}
    extra = sorted(set(found) - set(SHAPES))
    missing = [k for k in SHAPES if k not in found]
    if missing or extra:
        raise ValueError(f"{path}: keys {sorted(found)}; a latents file holds exactly {list(SHAPES)}"
                         + (f" (missing {missing})" if missing else "") + (f" (unexpected {extra})" if extra else ""))
    for key in SHAPES:
        _check_array(path, key, found[key].shape, found[key].is_floating_point())
    return {k: found[k].float() for k in SHAPES}


def _parquet(path: str) -> dict[str, Tensor]:
    """The samples of a .parquet file (one per row, see the module doc), stacked."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    need = [n for k in SHAPES for n in (k, f"{k}_shape")]
    missing = [n for n in need if n not in table.column_names]
    if missing:
        raise ValueError(f"{path}: columns {table.column_names}; a latents parquet file has {need} (missing "
                         f"{missing})")
    out = {}
    for key, dims in SHAPES.items():
        values, shapes = table.column(key).to_pylist(), table.column(f"{key}_shape").to_pylist()
        rows = []
        for r, (v, s) in enumerate(zip(values, shapes, strict=True)):
            where = f"{path} row {r}"
            if not isinstance(s, list) or len(s) != len(dims) - 1:
                raise ValueError(f"{where}: {key}_shape is {s!r}, expected [{', '.join(dims[1:])}]")
            if not isinstance(v, list) or len(v) != _prod(s):
                raise ValueError(f"{where}: {key!r} holds {len(v) if isinstance(v, list) else v!r} values, its shape "
                                 f"{s} needs {_prod(s)}")
            if rows and list(rows[0].shape) != s:
                raise ValueError(f"{where}: {key!r} has shape {s}, row 0 {list(rows[0].shape)}: every sample must "
                                 "have the same shape")
            rows.append(torch.tensor(v, dtype=torch.float32).reshape(s))
        if not rows:
            raise ValueError(f"{path}: no rows")
        out[key] = torch.stack(rows)
    return out


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def read_latents(paths: Sequence[str]) -> tuple[Tensor, Tensor, str]:
    """``(latents [N, C, F, H, W], text_embeds [N, L, D], what was read in words)`` of ``paths``.
    ValueError naming the file, key and shape for anything but the format of the module doc."""
    parts: list[dict[str, Tensor]] = []
    first = None
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"--data {path!r}: no such file")
        ext = os.path.splitext(path)[1].lower()
        if ext not in EXTS:
            raise ValueError(f"--data {path!r}: --objective flow-matching reads {', '.join(EXTS)} files "
                             f"({FORMATS_HELP})")
        arrays = _parquet(path) if ext == ".parquet" else _arrays(path)
        n = {k: int(v.shape[0]) for k, v in arrays.items()}
        if n[LATENTS] != n[TEXT]:
            raise ValueError(f"{path}: {n[LATENTS]} rows of {LATENTS!r} but {n[TEXT]} of {TEXT!r}: one sample per row "
                             "in both")
        shapes = {k: list(v.shape[1:]) for k, v in arrays.items()}
        if first is None:
            first = (path, shapes)
        elif shapes != first[1]:
            key = next(k for k in SHAPES if shapes[k] != first[1][k])
            raise ValueError(f"{path}: {key!r} samples are {shapes[key]}, but {first[0]}'s are {first[1][key]}: every "
                             "sample must have the same shape")
        parts.append(arrays)
    latents = torch.cat([p[LATENTS] for p in parts])
    text = torch.cat([p[TEXT] for p in parts])
    if latents.shape[0] == 0:
        raise ValueError("--data holds no sample")
    what = (f"{latents.shape[0]} samples from {len(paths)} file{'s' if len(paths) > 1 else ''}: latents "
            f"{list(latents.shape[1:])}, text embeddings {list(text.shape[1:])}")
    return latents, text, what


def load_latents(paths: Sequence[str], *, seed: int, eval_rows: int) -> LatentFiles:
    """The :class:`LatentFiles` of ``paths`` (see :func:`read_latents`)."""
    latents, text, what = read_latents(paths)
    return LatentFiles(latents, text, seed=seed, eval_rows=eval_rows, describe=what)
