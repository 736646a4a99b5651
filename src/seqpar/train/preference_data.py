"""Preference pairs for ``seqpar train --objective dpo|simpo|orpo|reward``: prompt / chosen / rejected
records tokenized as TRL 1.16's ``DPOTrainer`` tokenizes them, then cut into the units the data order
reads.

Tokens and masks (TRL's ``DPOTrainer._prepare_dataset`` and ``DataCollatorForPreference``)::

    text   prompt = tok(prompt)                      chosen = tok(prompt + chosen [+ EOS unless it ends so])
    chat   prompt = template(prompt, generation prompt)   chosen = template(prompt + chosen)
    n      = the shorter common prefix of prompt with (prompt + chosen) and with (prompt + rejected)
    each sequence = its tokens, the first n being the prompt; cut to --seq-len keeping the start
    targets (completion_mask) = the tokens after the first n; a pair whose prompt alone fills
    --seq-len is left out (nothing to learn, as TRL drops it)

Units (one entry of the data order, :func:`seqpar.train.sources.row_index`)::

    one pair per unit (default)   [2, S]: the chosen row, then the rejected row, each padded
    --packing                     [1, S]: whole pairs, chosen then rejected, one after the other; a
                                  pair never crosses a row edge (one that does not fit starts the next)

A batch of units holds its sequences in the order c0 r0 c1 r1 ...: the objectives' "interleaved"
pairing, whatever the packing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from seqpar.batch.targets import IGNORE_INDEX
from seqpar.objectives.trl_formats import kl_completions, unpaired_rows

from .data import TextData, row_tensors
from .formats import PREFERENCE, Record, read_records, read_rows
from .tokenizer import (
    ByteTokenizer,
    Document,
    HFTokenizer,
    check_chat_support,
    common_prefix,
    prompt_completion_tokenizer,
)

Pair = tuple[Document, Document]


def _ids(tok: ByteTokenizer | HFTokenizer, prompt: object, completion: object | None, *, gen: bool = False
         ) -> list[int]:
    """The tokens of ``prompt`` (+ ``completion``) as TRL's ``_tokenize`` gives them."""
    if isinstance(prompt, str):
        text = prompt + (completion or "")
        if isinstance(tok, HFTokenizer):
            return tok.sft_text(text, eos=completion is not None)
        return tok.encode(text, eos=completion is not None)
    assert isinstance(tok, HFTokenizer)
    messages = [*prompt, *(completion or ())]  # type: ignore[misc]
    return tok.chat(messages, generation_prompt=gen)[0]


def encode_pair(record: Record, tok: ByteTokenizer | HFTokenizer) -> Pair:
    """``(chosen, rejected)`` documents of one preference record (see the module doc)."""
    prompt = _ids(tok, record.prompt, None, gen=True)
    chosen = _ids(tok, record.prompt, record.chosen)
    rejected = _ids(tok, record.prompt, record.rejected)
    n = min(common_prefix(prompt, chosen), common_prefix(prompt, rejected))
    return (Document(chosen, [i >= n for i in range(len(chosen))]),
            Document(rejected, [i >= n for i in range(len(rejected))]))


def _cut(doc: Document, seq_len: int) -> Document:
    return Document(doc.ids[:seq_len], doc.targets[:seq_len])


def pair_units(pairs: Sequence[Pair], seq_len: int, *, packing: bool, pad_id: int
               ) -> tuple[list[dict[str, Tensor]], int, int]:
    """``(units, pairs kept, sequences cut)``: the units of the module doc. Raises ValueError for a
    pair that cannot share one packed row."""
    units: list[dict[str, Tensor]] = []
    kept = cut = 0
    ids: list[int] = []
    tgt: list[bool] = []
    pos: list[int] = []
    for c, r in pairs:
        if c.targets.count(False) >= seq_len:  # the prompt alone fills the row: nothing to learn
            continue
        cut += (len(c.ids) > seq_len) + (len(r.ids) > seq_len)
        c, r = _cut(c, seq_len), _cut(r, seq_len)
        kept += 1
        if not packing:
            rows = [row_tensors(d.ids, d.targets, list(range(len(d.ids))), seq_len, pad_id) for d in (c, r)]
            units.append({k: torch.stack([row[k] for row in rows]) for k in rows[0]})
            continue
        if len(c.ids) + len(r.ids) > seq_len:
            raise ValueError(f"--packing keeps a pair's chosen and rejected sequences in one row, and a pair of "
                             f"{len(c.ids)} + {len(r.ids)} tokens does not fit in --seq-len {seq_len}: raise "
                             "--seq-len or leave out --packing (one sequence per row)")
        if len(ids) + len(c.ids) + len(r.ids) > seq_len:
            units.append({k: v[None] for k, v in row_tensors(ids, tgt, pos, seq_len, pad_id).items()})
            ids, tgt, pos = [], [], []
        for d in (c, r):
            ids, tgt, pos = ids + d.ids, tgt + d.targets, pos + list(range(len(d.ids)))
    if ids:
        units.append({k: v[None] for k, v in row_tensors(ids, tgt, pos, seq_len, pad_id).items()})
    return units, kept, cut


def load_preference_data(paths: Sequence[str], tok: ByteTokenizer | HFTokenizer, *, seq_len: int, packing: bool,
                         seed: int, eval_rows: int) -> TextData:
    """Read and tokenize preference records into units, split into training and held-out units.
    ValueError for other records, bad files, or a tokenizer the data cannot use."""
    records = read_records(paths)
    other = next((r for r in records if r.kind != PREFERENCE), None)
    if other is not None:
        raise ValueError(f"{other.where} is {other.kind} data, not a preference pair (prompt, chosen, rejected): "
                         "train on it with --objective sft")
    check_chat_support(records, tok, "all")
    pairs = [encode_pair(r, tok) for r in records]
    units, kept, cut = pair_units(pairs, seq_len, packing=packing, pad_id=tok.pad_id)
    kind = "chat" if not isinstance(records[0].prompt, str) else "text"
    targets = sum(int((u["labels"] != IGNORE_INDEX).sum()) for u in units)
    what = (f"{len(records)} preference pairs ({kind}, {getattr(tok, 'name', 'tokenizer')}) in {len(units)} "
            f"{'packed rows' if packing else 'pairs of rows'}, loss on the completions ({targets} targets)")
    if cut:
        what += f"; {cut} sequences longer than --seq-len {seq_len} cut to it (the start kept, as TRL)"
    if kept < len(pairs):
        what += f"; {len(pairs) - kept} pairs left out: the prompt alone fills --seq-len {seq_len}"
    data = TextData(units, seed=seed, eval_rows=eval_rows, vocab_size=tok.vocab_size, describe=what)
    data.chance = 0.5
    return data


# --------------------------------------------------------------------------------------------
# KTO's unpaired rows
# --------------------------------------------------------------------------------------------

def kto_unit(prompt: list[int], completion: list[int], kl_completion: list[int], desirable: bool, seq_len: int,
             pad_id: int) -> dict[str, Tensor] | None:
    """One KTO unit ``[2, S]``: the row (prompt, completion: its targets) and its KL row (the prompt with
    another row's completion, :func:`seqpar.objectives.trl_formats.kl_completions`), each cut to
    ``seq_len`` keeping the start (as TRL); ``desirable`` the row's label on every token. None when the
    prompt alone fills the row (nothing to learn)."""
    if len(prompt) >= seq_len:
        return None
    docs = [_cut(Document(prompt + c, [False] * len(prompt) + [True] * len(c)), seq_len)
            for c in (completion, kl_completion)]
    rows = [row_tensors(d.ids, d.targets, list(range(len(d.ids))), seq_len, pad_id) for d in docs]
    unit = {k: torch.stack([row[k] for row in rows]) for k in rows[0]}
    unit["desirable"] = torch.full((2, seq_len), float(desirable), dtype=torch.float64)
    return unit


def load_unpaired(paths: Sequence[str], tok: ByteTokenizer | HFTokenizer, *, seq_len: int, micro_batch: int,
                  seed: int, eval_rows: int) -> TextData:
    """KTO's data (TRL 1.16's ``KTOTrainer`` formats): unpaired rows (prompt, completion, label), or
    preference pairs unpaired in TRL's order (explicit or implicit prompt), tokenized as TRL's KTO
    tokenizes them, each unit carrying its KL row (TRL's rotation of the completions within blocks of
    ``micro_batch`` rows in file order) -- see :func:`kto_unit`. ValueError naming the row at fault."""
    rows = read_rows(paths)
    kto_rows = unpaired_rows([r for _, r in rows], [w for w, _ in rows])
    where = [w for w, _ in rows] if len(kto_rows) == len(rows) else [f"{w} (unpaired)" for w, _ in rows] * 2
    tokenize = prompt_completion_tokenizer(tok)
    split = []
    for row, w in zip(kto_rows, where, strict=False):
        if not isinstance(row.get("prompt"), (str, list)) or not isinstance(row.get("completion"), (str, list)):
            raise ValueError(f"{w}: 'prompt' and 'completion' must be strings or lists of chat messages")
        ids, mask = tokenize(row["prompt"], row["completion"])
        n = mask.index(True) if True in mask else len(ids)
        split.append((list(ids[:n]), list(ids[n:]), bool(row["label"])))
    kl = kl_completions([c for _, c, _ in split], micro_batch)
    units = [u for (p, c, good), other in zip(split, kl, strict=True)
             if (u := kto_unit(p, c, other, good, seq_len, tok.pad_id)) is not None]
    good = sum(g for _, _, g in split)
    name = getattr(tok, "name", "tokenizer")
    what = (f"{len(split)} unpaired rows ({good} desirable, {len(split) - good} not; {name}) with their KL rows "
            f"(completions rotated within blocks of --micro-batch {micro_batch}), loss on the "
            "completions")
    if len(units) < len(split):
        what += f"; {len(split) - len(units)} left out: the prompt alone fills --seq-len {seq_len}"
    return TextData(units, seed=seed, eval_rows=eval_rows, vocab_size=tok.vocab_size, describe=what)
