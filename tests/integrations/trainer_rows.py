"""The Trainer tests' "script" data, one home for it: tokenized rows and their right-padding collator
(the same rows with and without seqpar, any layout)."""

from __future__ import annotations

import torch

VOCAB = 128


def rows(n: int, seed: int) -> list[dict[str, list[int]]]:
    """``n`` tokenized rows of 9..30 tokens; labels are the ids with the first two ignored."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(9, 31, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100, -100, *ids[2:]]})
    return out


def collate(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pads ``batch`` to its longest row: ids 0, labels -100, attention_mask 0 there."""
    width = max(len(r["input_ids"]) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, r in enumerate(batch):
        n = len(r["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
