"""Data of ``seqpar train``: tokenized documents into rows, the held-out split and the data order.

Files are read by :mod:`.formats` and tokenized by :mod:`.tokenizer` into documents (token ids and,
per token, whether it is a target). Documents become rows of exactly ``seq_len`` tokens
(``labels`` = the token where it is a target, else ignored):

* one document per row (default): the row is padded (``attention_mask`` 0, no target);
* ``packing``: documents follow each other in the row, ``position_ids`` restart at 0 where each
  one starts (seqpar then keeps attention and targets inside documents, and every document's
  targets as they were); only the last row is padded.

A document longer than ``seq_len`` (``--overflow``): **split** -- it goes on in the next row,
positions restarting (one document per row: ``seq_len`` pieces; packed: wherever a row ends, so
documents flow across row edges); **truncate** -- its first ``seq_len`` tokens, the rest dropped,
and with packing a document never crosses a row edge (one that does not fit in the rest of a row
starts the next). ``auto``: split for plain text, truncate as soon as there is chat or prompt /
completion data (an SFT example cut in two loses its prompt).

Order: row ``k`` of the whole run (counted over steps, micro-batches, dp ranks, rows) is a pure
function of ``(seed, k)`` -- an epoch-wise shuffle -- so resuming at a step reads exactly the rows
the uninterrupted run would have read, whatever the number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from seqpar.batch.targets import IGNORE_INDEX

from .formats import PREFERENCE, TEXT, count_kinds, read_records
from .sources import EVAL, TRAIN, rows_in
from .tokenizer import ByteTokenizer, Document, HFTokenizer, encode_records

OVERFLOW = ("auto", "split", "truncate")


def read_documents(paths: Sequence[str], text_field: str = "text") -> list[str]:
    """The texts of plain-text data in ``paths`` (chat or prompt / completion records: ValueError).
    Raises ValueError naming the file (and line) at fault."""
    records = read_records(paths, text_field)
    other = next((r for r in records if r.kind != TEXT), None)
    if other is not None:
        raise ValueError(f"{other.where} is {other.kind} data, not plain text")
    return [r.text for r in records]


def resolve_overflow(overflow: str, kinds: Sequence[str]) -> str:
    """``--overflow`` with ``auto`` resolved: split for plain text only, else truncate."""
    if overflow not in OVERFLOW:
        raise ValueError(f"unknown --overflow {overflow!r}: choose one of {list(OVERFLOW)}")
    if overflow != "auto":
        return overflow
    return "split" if set(kinds) <= {TEXT} else "truncate"


@dataclass(frozen=True)
class RowStats:
    """What became of the documents: counts for the run's description of its data."""

    documents: int
    tokens: int
    targets: int  # tokens in the rows whose prediction carries the loss
    longer: int  # documents longer than seq_len
    dropped_tokens: int  # cut off by truncate
    pieces: int  # what the longer documents became (split: pieces; truncate: the same count)
    no_target: int  # documents (or pieces) left out: nothing to predict
    rows: int


def row_tensors(ids: list[int], targets: list[bool], positions: list[int], seq_len: int, pad_id: int
                ) -> dict[str, Tensor]:
    """One row of ``seq_len`` tokens: ``ids`` then padding; labels where ``targets``; position ids."""
    n = len(ids)
    input_ids = torch.full((seq_len,), pad_id, dtype=torch.long)
    input_ids[:n] = torch.tensor(ids, dtype=torch.long)
    mask = torch.zeros(seq_len, dtype=torch.long)
    mask[:n] = 1
    pos = torch.arange(seq_len, dtype=torch.long)
    pos[:n] = torch.tensor(positions, dtype=torch.long)
    keep = torch.zeros(seq_len, dtype=torch.bool)
    keep[:n] = torch.tensor(targets, dtype=torch.bool)
    labels = input_ids.masked_fill(~keep, IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "position_ids": pos}


def _counted(targets: Sequence[bool]) -> int:
    """Targets a document (or piece) really has: its first token has none (nothing precedes it)."""
    return sum(targets[1:])


def _as_document(doc: Document | Sequence[int]) -> Document:
    return doc if isinstance(doc, Document) else Document(list(doc), [True] * len(doc))


def build_rows(docs: Sequence[Document | Sequence[int]], seq_len: int, *, packing: bool, pad_id: int,
               overflow: str = "split") -> tuple[list[dict[str, Tensor]], RowStats]:
    """Rows of ``seq_len`` tokens (see the module docstring) and what became of the documents.
    ``docs``: :class:`Document` s, or plain token lists (every token a target). ``overflow``: split
    or truncate."""
    assert overflow in ("split", "truncate"), overflow
    docs = [_as_document(d) for d in docs]
    n_docs, n_tokens = len(docs), sum(len(d.ids) for d in docs)
    longer = sum(len(d.ids) > seq_len for d in docs)
    dropped = sum(max(0, len(d.ids) - seq_len) for d in docs) if overflow == "truncate" else 0
    pieces_of_longer = longer if overflow == "truncate" else sum(-(-len(d.ids) // seq_len) for d in docs
                                                                    if len(d.ids) > seq_len)
    if overflow == "truncate":
        docs = [Document(d.ids[:seq_len], d.targets[:seq_len]) for d in docs]
    elif not packing:
        docs = [Document(d.ids[s:s + seq_len], d.targets[s:s + seq_len]) for d in docs
                for s in range(0, len(d.ids), seq_len)]
    kept = [d for d in docs if _counted(d.targets)]
    rows: list[dict[str, Tensor]] = []
    if not packing:
        rows = [row_tensors(d.ids, d.targets, list(range(len(d.ids))), seq_len, pad_id) for d in kept]
    else:
        ids: list[int] = []
        tgt: list[bool] = []
        pos: list[int] = []
        for doc in kept:
            if overflow == "truncate" and len(ids) + len(doc.ids) > seq_len:  # never across a row edge
                rows.append(row_tensors(ids, tgt, pos, seq_len, pad_id))
                ids, tgt, pos = [], [], []
            rest, rest_t = doc.ids, doc.targets
            while rest:
                take = seq_len - len(ids)
                ids += rest[:take]
                tgt += rest_t[:take]
                pos += range(len(rest[:take]))  # a document cut at a row edge restarts in the next row
                rest, rest_t = rest[take:], rest_t[take:]
                if len(ids) == seq_len:
                    rows.append(row_tensors(ids, tgt, pos, seq_len, pad_id))
                    ids, tgt, pos = [], [], []
        if ids:
            rows.append(row_tensors(ids, tgt, pos, seq_len, pad_id))
        rows = [r for r in rows if _row_targets(r)]  # a row without a target teaches nothing
    stats = RowStats(documents=n_docs, tokens=n_tokens, targets=sum(_row_targets(r) for r in rows),
                     longer=longer, dropped_tokens=dropped, pieces=pieces_of_longer, no_target=len(docs) - len(kept),
                     rows=len(rows))
    return rows, stats


def _row_targets(row: dict[str, Tensor]) -> int:
    """Targets of a row that count: not padding, not the first token of a document."""
    return int(((row["labels"] != IGNORE_INDEX) & (row["position_ids"] > 0) & (row["attention_mask"] > 0)).sum())


def make_rows(docs: Sequence[Document | Sequence[int]], seq_len: int, *, packing: bool, pad_id: int,
              overflow: str = "split") -> list[dict[str, Tensor]]:
    """Rows of ``seq_len`` tokens from tokenized documents (see :func:`build_rows`)."""
    return build_rows(docs, seq_len, packing=packing, pad_id=pad_id, overflow=overflow)[0]


class TextData:
    """Units from files, split into training and held-out units (seeded): a :class:`~.sources.DataSource`."""

    def __init__(self, rows: list[dict[str, Tensor]], *, seed: int, eval_rows: int, vocab_size: int,
                 describe: str) -> None:
        if not rows:
            raise ValueError("--data has no document with a target (two tokens or more, or a response to learn): "
                             "nothing to learn")
        perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
        n_eval = min(eval_rows, len(rows) // 10)
        self.eval = [rows[i] for i in perm[:n_eval]]
        self.train = [rows[i] for i in perm[n_eval:]]
        self.seed = seed
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its permutation): rows are read in order
        self.vocab_size = vocab_size
        self.max_token_id = max(int(r["input_ids"].max()) for r in rows)
        self._describe = describe
        if n_eval < eval_rows:
            self._describe += (f"; {n_eval} held-out row{'s' if n_eval != 1 else ''} (--eval-rows {eval_rows} is "
                               f"capped at a tenth of the {len(rows)} rows)")
        self.chance: float | None = None
        self.rows_per_unit = rows_in(rows[0])

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


def describe_rows(kinds: dict[str, int], stats: RowStats, *, tokenizer: str, seq_len: int, packing: bool,
                  overflow: str, train_on: str) -> str:
    """The data in words: what was read, tokens and targets, rows, and the overflow policy applied."""
    names = {TEXT: "documents", "chat": "chats", "prompt/completion": "prompt/completion pairs"}
    if len(kinds) == 1:
        what = f"{stats.documents} {names[next(iter(kinds))]}"
    else:
        what = f"{stats.documents} documents ({', '.join(f'{n} {names[k]}' for k, n in kinds.items())})"
    loss = ""
    if set(kinds) - {TEXT}:
        loss = (f", loss on {'every token' if train_on == 'all' else 'responses only'} "
                f"({stats.targets} targets)")
    out = (f"{what}, {stats.tokens} tokens ({tokenizer}) in {stats.rows} rows{' (packed)' if packing else ''}{loss}")
    if stats.longer == 0:
        out += f"; none longer than --seq-len {seq_len} (--overflow {overflow})"
    elif overflow == "truncate":
        out += (f"; --overflow truncate: {stats.longer} longer than --seq-len {seq_len} cut to it "
                f"({stats.dropped_tokens} tokens dropped; --overflow split keeps them)")
    else:
        out += (f"; --overflow split: {stats.longer} longer than --seq-len {seq_len} split into {stats.pieces} pieces "
                "(--overflow truncate drops the rest instead)")
    if stats.no_target:
        out += f"; {stats.no_target} without a target left out"
    return out


def load_text_data(paths: Sequence[str], tok: ByteTokenizer | HFTokenizer, *, text_field: str, train_on: str,
                   seq_len: int, packing: bool, overflow: str, seed: int, eval_rows: int) -> TextData:
    """Read, tokenize and row ``paths``: the :class:`TextData` of a run. ValueError for bad files,
    a tokenizer the data cannot use, or data with nothing to learn."""
    records = read_records(paths, text_field)
    pair = next((r for r in records if r.kind == PREFERENCE), None)
    if pair is not None:
        raise ValueError(f"{pair.where} is a preference pair (prompt / chosen / rejected): train on pairs with "
                         "--objective dpo (or simpo, orpo, reward)")
    kinds = count_kinds(records)
    policy = resolve_overflow(overflow, list(kinds))
    docs = encode_records(records, tok, train_on)
    rows, stats = build_rows(docs, seq_len, packing=packing, pad_id=tok.pad_id, overflow=policy)
    what = describe_rows(kinds, stats, tokenizer=getattr(tok, "name", "tokenizer"), seq_len=seq_len, packing=packing,
                         overflow=policy, train_on=train_on)
    return TextData(rows, seed=seed, eval_rows=eval_rows, vocab_size=tok.vocab_size, describe=what)
