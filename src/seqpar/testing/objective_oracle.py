"""The float64 oracle of the objectives: each sequence (a row's real tokens, or one packed document)
run alone through the unsharded model in plain PyTorch -- full logits, ``log_softmax``, the score
head on the last token -- and the batches the objective tests shard (padded left and right, packed,
pairs whose documents straddle shards, odd lengths).

The loss formulas themselves are restated in the tests, from TRL 1.16's text, not taken from
:mod:`seqpar.objectives`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..batch.targets import IGNORE_INDEX


@dataclass
class SeqTerms:
    """The oracle's per-sequence view: for sequence k, ``logps[k]`` / ``entropy[k]`` ``[L_k - 1]``
    (one per target position, 0 where ignored), ``mask[k]`` (the target is counted), ``score[k]``
    ``[K]`` (the score head at the last token), ``values[k]`` ``[L_k - 1]``, and ``where[k]`` the
    ``(row, original index of each target token)`` to read per-token inputs aligned with the labels."""

    logps: list[Tensor]
    entropy: list[Tensor]
    mask: list[Tensor]
    score: list[Tensor]
    values: list[Tensor]
    where: list[tuple[int, Tensor]]


def sequence_spans(batch: dict[str, Tensor]) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every sequence, row by row, documents in order (seqpar's numbering)."""
    ids = batch["input_ids"]
    b, s = ids.shape
    spans = []
    for row in range(b):
        keep = batch["attention_mask"][row].bool() if "attention_mask" in batch else torch.ones(s, dtype=torch.bool)
        real = keep.nonzero().flatten()
        lo, hi = int(real[0]), int(real[-1]) + 1
        if "position_ids" in batch and "attention_mask" not in batch:
            pos = batch["position_ids"].expand(b, s)[row]
            starts = [*(pos == 0).nonzero().flatten().tolist(), s]
            spans += [(row, a, c) for a, c in zip(starts[:-1], starts[1:], strict=True)]
        else:
            spans.append((row, lo, hi))
    return spans


def oracle_terms(model: nn.Module, batch: dict[str, Tensor], *, kind: str = "lm", temperature: float = 1.0
                 ) -> SeqTerms:
    """Run every sequence of ``batch`` alone. ``kind``: "lm" (a causal LM: log-probs and entropy of
    the labels' targets) or "score" (a sequence-classification model: per-token and last-token scores)."""
    out = SeqTerms([], [], [], [], [], [])
    for row, a, c in sequence_spans(batch):
        ids = batch["input_ids"][row:row + 1, a:c]
        labels = batch["labels"][row, a:c] if "labels" in batch else torch.full((c - a,), IGNORE_INDEX)
        target, mask = labels[1:], labels[1:] != IGNORE_INDEX
        out.mask.append(mask)
        out.where.append((row, torch.arange(a + 1, c)))
        if kind == "lm":
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1] / temperature  # [L - 1, V]
            logp = torch.log_softmax(logits, -1)
            out.logps.append(logp.gather(-1, target.clamp(min=0)[:, None])[:, 0] * mask)
            out.entropy.append(-(logp.exp() * logp).sum(-1))
        else:
            hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]  # [L, H]
            scores = model.score(hidden)  # [L, K]
            out.score.append(scores[-1])
            out.values.append(scores[:-1, 0])
    return out


def token_input(column: Tensor, terms: SeqTerms, k: int) -> Tensor:
    """A per-token input ``[B, S]`` aligned with the labels, read at sequence k's target tokens."""
    row, idx = terms.where[k]
    return column[row, idx]


def make_batch(kind: str, s: int, vocab: int, *, seqs: int = 4, seed: int = 0, prompt: int = 3
               ) -> dict[str, Tensor]:
    """A full batch of ``seqs`` sequences of about ``s`` tokens, ids in ``1..vocab-1`` (0 is the pad
    id), the first ``prompt`` tokens of each sequence without a label. ``kind``: "padded" (one
    sequence per row of length ``s``, some shorter: right padding, one row left-padded with
    transformers' position ids), "packed" (two rows of length ``s``, the sequences as documents, so
    that a document -- and a pair -- crosses shard boundaries)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "padded":
        ids = torch.randint(1, vocab, (seqs, s), generator=g)
        mask = torch.ones(seqs, s, dtype=torch.long)
        lens = [s - (i * 3) % max(s // 2, 1) for i in range(seqs)]
        pos = torch.arange(s).repeat(seqs, 1)
        for i, n in enumerate(lens):
            if i == 1:  # left padding
                mask[i, : s - n] = 0
                pos[i] = (mask[i].cumsum(0) - 1).masked_fill(mask[i] == 0, 1)
            else:
                mask[i, n:] = 0
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        first = mask.argmax(1)
        for i in range(seqs):
            labels[i, first[i]: first[i] + prompt] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": pos}
    if kind == "packed":
        rows = 2
        ids = torch.randint(1, vocab, (rows, s), generator=g)
        per_row = seqs // rows
        pos = torch.empty(rows, s, dtype=torch.long)
        labels = ids.clone()
        for r in range(rows):
            cuts = [round(s * (j + 1) / (per_row + 0.5)) for j in range(per_row - 1)]
            lens = [b - a for a, b in zip([0, *cuts], [*cuts, s], strict=True)]
            pos[r] = torch.cat([torch.arange(n) for n in lens])
            for start in [0, *cuts]:
                labels[r, start: start + prompt] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels, "position_ids": pos}
    raise ValueError(f"unknown batch kind {kind!r}: padded or packed")
