"""Data for ``seqpar train``: user files turned into rows, and the order rows are read in.

Files: ``*.jsonl`` / ``*.json`` hold one JSON object per line with a text field; anything else is
one plain-text document per file. Documents become rows of exactly ``seq_len`` tokens:

* one document per row (default): long documents are cut into ``seq_len`` chunks, the last
  chunk padded (``attention_mask`` 0, no target);
* ``packing``: documents follow each other in the row, ``position_ids`` restart at 0 where each
  one starts (seqpar then keeps attention and targets inside documents); only the very last row
  is padded.

Order: row ``k`` of the whole run (counted over steps, micro-batches, dp ranks, rows) is a pure
function of ``(seed, k)`` -- an epoch-wise shuffle -- so resuming at a step reads exactly the rows
the uninterrupted run would have read, whatever the number of ranks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .tasks import EVAL, IGNORE, TRAIN, CopyTask

JSONL_EXTS = (".jsonl", ".json")


def read_documents(paths: Sequence[str], text_field: str = "text") -> list[str]:
    """The documents of ``paths``. Raises ValueError naming the file (and line) at fault."""
    if not paths:
        raise ValueError("--data needs at least one file")
    docs: list[str] = []
    for path in paths:
        if not os.path.exists(path):
            raise ValueError(f"--data {path!r}: no such file")
        if os.path.isdir(path):
            raise ValueError(f"--data {path!r} is a directory: give the files in it (e.g. {path}/*.jsonl)")
        with open(path, encoding="utf-8", errors="replace") as f:
            content = f.read()
        if not content.strip():
            raise ValueError(f"--data {path!r} is empty")
        if not path.lower().endswith(JSONL_EXTS):
            docs.append(content)
            continue
        for lineno, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict) or text_field not in obj:
                keys = list(obj) if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(f"{path}:{lineno}: no {text_field!r} field (found {keys}); "
                                 f"set --text-field to the field that holds the text")
            if not isinstance(obj[text_field], str):
                raise ValueError(f"{path}:{lineno}: field {text_field!r} must be a string, "
                                 f"got {type(obj[text_field]).__name__}")
            docs.append(obj[text_field])
        if not docs:
            raise ValueError(f"--data {path!r} holds no documents")
    return docs


def _row(ids: list[int], positions: list[int], seq_len: int, pad_id: int) -> dict[str, Tensor]:
    n = len(ids)
    input_ids = torch.full((seq_len,), pad_id, dtype=torch.long)
    input_ids[:n] = torch.tensor(ids, dtype=torch.long)
    mask = torch.zeros(seq_len, dtype=torch.long)
    mask[:n] = 1
    pos = torch.arange(seq_len, dtype=torch.long)
    pos[:n] = torch.tensor(positions, dtype=torch.long)
    labels = input_ids.masked_fill(mask == 0, IGNORE)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "position_ids": pos}


def make_rows(docs: Sequence[list[int]], seq_len: int, *, packing: bool, pad_id: int) -> list[dict[str, Tensor]]:
    """Rows of ``seq_len`` tokens from tokenized documents (see the module docstring)."""
    rows: list[dict[str, Tensor]] = []
    if not packing:
        for doc in docs:
            for start in range(0, len(doc), seq_len):
                chunk = doc[start:start + seq_len]
                if len(chunk) >= 2:  # one token has no target
                    rows.append(_row(chunk, list(range(len(chunk))), seq_len, pad_id))
        return rows
    ids: list[int] = []
    pos: list[int] = []
    for doc in docs:
        rest = doc
        while rest:
            take = rest[:seq_len - len(ids)]
            ids += take
            pos += range(len(take))  # a document cut at a row edge restarts in the next row
            rest = rest[len(take):]
            if len(ids) == seq_len:
                rows.append(_row(ids, pos, seq_len, pad_id))
                ids, pos = [], []
    if ids:
        rows.append(_row(ids, pos, seq_len, pad_id))
    return [r for r in rows if int(r["attention_mask"].sum()) >= 2]  # a row without a target teaches nothing


class TextData:
    """Rows from files, split into training rows and held-out rows (seeded)."""

    def __init__(self, rows: list[dict[str, Tensor]], *, seed: int, eval_rows: int, vocab_size: int,
                 describe: str) -> None:
        if not rows:
            raise ValueError("--data has no document of two tokens or more: nothing to learn")
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
        n_eval = min(eval_rows, len(rows) // 10)
        self.eval = [rows[i] for i in perm[:n_eval]]
        self.train = [rows[i] for i in perm[n_eval:]]
        self.seed = seed
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its permutation): rows are read in order
        self.vocab_size = vocab_size
        self._describe = describe
        self.chance: float | None = None


    def row(self, index: int, split: int = TRAIN) -> dict[str, Tensor]:
        if split == EVAL:
            return self.eval[index]
        n = len(self.train)
        epoch, k = divmod(index, n)
        if self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch + 1)
            self._order = (epoch, torch.randperm(n, generator=g).tolist())
        return self.train[self._order[1][k]]

    @property
    def n_eval(self) -> int:
        return len(self.eval)

    def describe(self) -> str:
        return self._describe


@dataclass
class TaskData:
    """The embedded copy task as a data source."""

    task: CopyTask
    eval_rows: int

    @property
    def vocab_size(self) -> int:
        return self.task.vocab_size

    @property
    def chance(self) -> float:
        return self.task.chance

    @property
    def n_eval(self) -> int:
        return self.eval_rows

    def row(self, index: int, split: int = TRAIN) -> dict[str, Tensor]:
        return self.task.row(index, split)

    def describe(self) -> str:
        return self.task.describe()


def stack(rows: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Rows of ``[S]`` tensors -> a batch of ``[B, S]`` tensors."""
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def row_index(step: int, micro: int, dp_rank: int, b: int, *, grad_accum: int, dp: int, micro_batch: int) -> int:
    """Which row of the run (counted from 0) rank ``dp_rank`` reads at ``(step, micro, b)``."""
    return ((step * grad_accum + micro) * dp + dp_rank) * micro_batch + b
