"""Tokenizers for ``seqpar train --data``: the model's own, or bytes when it has none."""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes, shifted past three special ids (PAD 0, BOS 1, EOS 2): any text, 259 ids."""

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3
    vocab_size = 256 + OFFSET
    pad_id = PAD
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        """``[BOS, bytes..., EOS]``: documents keep their edges when packed."""
        return [self.BOS, *(b + self.OFFSET for b in text.encode("utf-8")), self.EOS]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - self.OFFSET for i in ids if i >= self.OFFSET).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer, with its BOS / EOS around each document where it defines them."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.vocab_size = len(tok)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.name = type(tok).__name__

    def encode(self, text: str) -> list[int]:
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        if self.tok.bos_token_id is not None:
            ids.insert(0, int(self.tok.bos_token_id))
        if self.tok.eos_token_id is not None:
            ids.append(int(self.tok.eos_token_id))
        return ids


def make_tokenizer(hf_tokenizer: Any | None) -> ByteTokenizer | HFTokenizer:
    """The model's tokenizer if it has one, else bytes."""
    return HFTokenizer(hf_tokenizer) if hf_tokenizer is not None else ByteTokenizer()
