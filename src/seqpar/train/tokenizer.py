"""Tokenizers for ``seqpar train --data``: the model's own (or ``--tokenizer``), or bytes when it has none.

Records (:mod:`.formats`) become :class:`Document` s -- token ids and, per token, whether its
prediction carries the loss -- the way TRL's ``SFTTrainer`` prepares them:

* text: ``[BOS] text [EOS]`` (where the tokenizer defines them), every token a target;
* chat: the tokenizer's chat template (``apply_chat_template``), targets on the assistant turns only
  -- the tokens inside the template's ``{% generation %}`` markers, what
  ``return_assistant_tokens_mask`` returns -- or on every token (``--train-on all``);
* prompt / completion: the tokens of prompt + completion (strings: as TRL tokenizes them, the
  tokenizer's own special tokens and its EOS after the completion), targets from where they stop
  agreeing with the prompt's own tokens (TRL's ``completion_mask``); messages go through the chat
  template, the prompt with ``add_generation_prompt``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from seqpar.objectives.trl_formats import HFTokenizer as TrlHFTokenizer
from seqpar.objectives.trl_formats import common_prefix, tokenize_prompt_completion

from .formats import CHAT, PREFERENCE, PROMPT_COMPLETION, TEXT, Record

TRAIN_ON = ("responses", "all")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Document:
    """One tokenized document: ``ids`` and ``targets`` (per token: its prediction carries the loss)."""

    ids: list[int]
    targets: list[bool]

    def __post_init__(self) -> None:
        assert len(self.ids) == len(self.targets)


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    name: str

    def encode(self, text: str, *, eos: bool = True) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes, shifted past three special ids (PAD 0, BOS 1, EOS 2): any text, 259 ids."""

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3
    vocab_size = 256 + OFFSET
    pad_id = PAD
    name = "bytes"
    chat_template = None

    def encode(self, text: str, *, eos: bool = True) -> list[int]:
        """``[BOS, bytes..., EOS]``: documents keep their edges when packed."""
        return [self.BOS, *(b + self.OFFSET for b in text.encode("utf-8")), *([self.EOS] if eos else [])]

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

    @property
    def chat_template(self) -> str | None:
        """The template ``apply_chat_template`` uses, or None if the tokenizer has none."""
        try:
            return self.tok.get_chat_template()
        except ValueError:  # transformers: "Cannot use chat template functions because ... not set"
            return None

    def encode(self, text: str, *, eos: bool = True) -> list[int]:
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        if self.tok.bos_token_id is not None:
            ids.insert(0, int(self.tok.bos_token_id))
        if eos and self.tok.eos_token_id is not None:
            ids.append(int(self.tok.eos_token_id))
        return ids

    def sft_text(self, text: str, *, eos: bool = False) -> list[int]:
        """``text`` as TRL's SFTTrainer tokenizes it: the tokenizer's own special tokens
        (``add_special_tokens``), and ``eos``: its EOS token appended to the text unless it ends with it."""
        if eos and self.tok.eos_token and not text.endswith(self.tok.eos_token):
            text += self.tok.eos_token
        return list(self.tok(text)["input_ids"])

    def chat(self, messages: Sequence[dict[str, str]], *, assistant_mask: bool = False,
             generation_prompt: bool = False) -> tuple[list[int], list[int] | None]:
        """``(ids, assistant mask or None)`` of ``messages`` through the chat template."""
        out = self.tok.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                           add_generation_prompt=generation_prompt,
                                           return_assistant_tokens_mask=assistant_mask)
        return list(out["input_ids"]), (list(out["assistant_masks"]) if assistant_mask else None)


def make_tokenizer(hf_tokenizer: Any | None) -> ByteTokenizer | HFTokenizer:
    """The model's tokenizer if it has one, else bytes."""
    return HFTokenizer(hf_tokenizer) if hf_tokenizer is not None else ByteTokenizer()


def prompt_completion_tokenizer(tok: ByteTokenizer | HFTokenizer) -> Any:
    """``tokenize(prompt, completion) -> (ids, completion mask)`` with the run's tokenizer, as TRL
    tokenizes a prompt and its completion over a transformers tokenizer (KTO's and SFT's rule:
    :func:`seqpar.objectives.trl_formats.tokenize_prompt_completion`); over bytes, the prompt's bytes
    after BOS, then the completion's and EOS (text only)."""
    if isinstance(tok, HFTokenizer):
        trl_tok = TrlHFTokenizer(tok.tok)

        def tokenize(prompt: Any, completion: Any) -> tuple[list[int], list[bool]]:
            p, c = tokenize_prompt_completion({"prompt": prompt, "completion": completion}, trl_tok, "a row")
            return p + c, [False] * len(p) + [True] * len(c)
        return tokenize

    def tokenize_bytes(prompt: Any, completion: Any) -> tuple[list[int], list[bool]]:
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise ValueError("a chat prompt / completion needs a transformers tokenizer with a chat template (a "
                             "built-in model reads bytes): give --tokenizer DIR (or, for RL rollouts, the token ids: "
                             "prompt_ids and completion_ids)")
        p, c = tok.encode(prompt, eos=False), tok.encode(completion)[1:]  # one BOS, the completion's EOS
        return p + c, [False] * len(p) + [True] * len(c)
    return tokenize_bytes


def check_chat_support(records: Sequence[Record], tok: ByteTokenizer | HFTokenizer, train_on: str) -> None:
    """ValueError (naming the option to change) when the records need a chat template the
    tokenizer lacks, or assistant masks its template cannot give."""
    needs = [r for r in records
             if r.kind == CHAT or (r.kind in (PROMPT_COMPLETION, PREFERENCE) and not isinstance(r.prompt, str))]
    if not needs:
        return
    template = tok.chat_template
    if isinstance(tok, ByteTokenizer):  # --chat-template needs a tokenizer to apply it: that comes first
        raise ValueError(f"{needs[0].where} is chat data, which needs a transformers tokenizer with a chat template "
                         "(a built-in model reads bytes): give --tokenizer DIR (add --chat-template FILE if it has no "
                         "template), or --model CHECKPOINT with its tokenizer")
    if template is None:
        raise ValueError(f"{needs[0].where} is chat data, but the tokenizer ({tok.name}) has no chat template: give "
                         "--chat-template FILE (a Jinja template), or a tokenizer that has one (--tokenizer DIR)")
    if train_on == "responses" and any(r.kind == CHAT for r in needs) and not _GENERATION.search(template):
        raise ValueError("--train-on responses needs the assistant tokens, which transformers finds through the "
                         "chat template's {% generation %} ... {% endgeneration %} markers, and this template has "
                         "none: give a template with them (--chat-template FILE), or --train-on all (loss on every "
                         "token)")


def encode_record(record: Record, tok: ByteTokenizer | HFTokenizer, train_on: str) -> Document:
    """The :class:`Document` of one record (see the module docstring). ValueError for a chat whose
    template marked no assistant token although it has an assistant turn."""
    every = train_on == "all"
    if record.kind == TEXT:
        ids = tok.encode(record.text)
        return Document(ids, [True] * len(ids))
    assert isinstance(tok, HFTokenizer) or (record.kind == PROMPT_COMPLETION and isinstance(record.prompt, str))
    if record.kind == CHAT:
        ids, mask = tok.chat(record.messages, assistant_mask=not every)
        if mask is None:
            return Document(ids, [True] * len(ids))
        if not any(mask) and any(m["role"] == "assistant" for m in record.messages):
            raise ValueError(f"{record.where}: the chat template marked none of this chat's assistant tokens: its "
                             "{% generation %} markers must enclose each assistant message (or use --train-on all)")
        return Document(ids, [bool(m) for m in mask])
    if isinstance(record.prompt, str) and isinstance(tok, HFTokenizer):
        prompt = tok.sft_text(record.prompt)
        ids = tok.sft_text(record.prompt + record.completion, eos=True)
    elif isinstance(record.prompt, str):  # bytes: BOS, the text, EOS
        prompt = tok.encode(record.prompt, eos=False)
        ids = tok.encode(record.prompt + record.completion)
    else:
        prompt, _ = tok.chat(record.prompt, generation_prompt=True)
        ids, _ = tok.chat([*record.prompt, *record.completion])
    # the completion starts where the prompt's own tokens and the whole's stop agreeing (TRL's rule:
    # a template may render the prompt differently alone, tokens may merge across the boundary)
    start = 0 if every else common_prefix(prompt, ids)
    return Document(ids, [i >= start for i in range(len(ids))])


def encode_records(records: Sequence[Record], tok: ByteTokenizer | HFTokenizer, train_on: str) -> list[Document]:
    """Every record tokenized (:func:`encode_record`), after :func:`check_chat_support`."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"unknown --train-on {train_on!r}: choose one of {list(TRAIN_ON)}")
    check_chat_support(records, tok, train_on)
    return [encode_record(r, tok, train_on) for r in records]


def load_hf_tokenizer(model: str, tokenizer_dir: str = "", chat_template_file: str = "") -> Any | None:
    """The transformers tokenizer a run reads its data with: ``tokenizer_dir``, else the checkpoint
    directory ``model``'s own (None for a built-in name or a checkpoint without one); with
    ``chat_template_file``'s template instead of its own. ValueError if it cannot be loaded."""
    import os

    from seqpar.integrations.models import load_tokenizer

    path = tokenizer_dir or (model if os.path.isdir(model) else "")
    tok = None
    if path:
        try:
            tok = load_tokenizer(path)
        except Exception as e:  # transformers raises OSError / ValueError / ImportError by what is wrong
            option = "--tokenizer" if tokenizer_dir else "--model"
            raise ValueError(f"{option} {path!r}: its tokenizer cannot be loaded: {str(e).splitlines()[0]}") from None
        if tok is None and tokenizer_dir:
            raise ValueError(f"--tokenizer {tokenizer_dir!r} holds no tokenizer (tokenizer.json, "
                             "tokenizer_config.json, ...)")
    if chat_template_file:
        if tok is None:
            raise ValueError("--chat-template needs a transformers tokenizer: --tokenizer DIR, or --model CHECKPOINT "
                             "with its tokenizer (a built-in model reads bytes)")
        with open(chat_template_file, encoding="utf-8") as f:
            tok.chat_template = f.read()
    return tok
