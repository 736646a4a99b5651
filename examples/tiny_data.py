"""The examples' local data: ``data/stories.jsonl`` (96 short English texts shipped with the repo),
tokenized byte by byte (ASCII, ids < 128: the vocabulary of seqpar's built-in ``tiny-llama``)."""

from __future__ import annotations

import json
import os

import torch

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "stories.jsonl")
PAD, EOS = 0, 1  # control characters, absent from the texts


def load_texts(path: str = DATA) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def encode(text: str) -> list[int]:
    """Bytes of an ASCII text, then EOS."""
    return [b for b in text.encode("ascii")] + [EOS]


def load_rows(path: str = DATA) -> list[dict[str, list[int]]]:
    """Tokenized rows ``{"input_ids", "labels"}`` (labels = the ids: plain language modelling)."""
    rows = []
    for text in load_texts(path):
        ids = encode(text)
        rows.append({"input_ids": ids, "labels": list(ids)})
    return rows


def byte_tokenizer():
    """A transformers tokenizer for the same byte ids (TRL's SFTTrainer wants one for pad / eos)."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "</s>": EOS, "<unk>": 2, **{chr(i): i for i in range(32, 127)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


class PadCollator:
    """Right-pads rows to the longest of the batch: ``input_ids``, ``attention_mask``, ``labels``
    (-100 on padding). Deterministic, so every rank of an SP group builds the same batch."""

    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
