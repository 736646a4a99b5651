"""TRL 1.16's dataset formats, read and tokenized as TRL's trainers read them: pure functions over one
row (a dict) and a tokenizer, for ``seqpar train``'s data readers. TRL's names, TRL's rules::

    standard          strings: "prompt", "completion", "chosen", "rejected" (EOS appended to a
                      completion that does not end with it, as TRL does for text)
    conversational    lists of {"role", "content"} messages, through the chat template (the prompt
                      with its generation prompt)
    explicit prompt   "prompt" beside "chosen" / "rejected"
    implicit prompt   "chosen" and "rejected" only: the prompt is their longest shared beginning
                      (TRL's ``extract_prompt``: shared messages, or shared characters, a space before
                      the first difference going with the completions -- Anthropic HH's format);
                      two sides that share nothing are a ValueError naming the row
    paired            prompt, chosen, rejected (DPO, reward)
    unpaired          prompt, completion, label (KTO's; a paired set is unpaired as TRL's
                      ``unpair_preference_dataset`` does: per block of 1000 rows, the chosen rows then
                      the rejected rows)
    prompt-completion prompt, completion (SFT's, and KTO's unpaired rows)

Tokens (DPO's, KTO's and SFT's ``tokenize_fn``): ``p = tok(prompt)``, ``full = tok(prompt + completion)``;
the completion starts where the two diverge (``n``, the common prefix of ``p`` and ``full``; DPO: the
shorter of the two sides'), and the tokens are ``full[:n]`` + ``full[n:]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

Messages = list[dict[str, Any]]
UNPAIR_BLOCK = 1000  # datasets.map's default batch size, the block TRL's unpair_preference_dataset unpairs by


class TrlTokenizer(Protocol):
    """What TRL asks of a tokenizer: ``encode(text)`` (TRL: ``processing_class(text=text)["input_ids"]``,
    with the tokenizer's own special tokens), ``apply_chat(messages, add_generation_prompt)`` (the chat
    template, tokenized), and ``eos_token`` (the text TRL appends to a standard completion)."""

    eos_token: str

    def encode(self, text: str) -> list[int]: ...

    def apply_chat(self, messages: Messages, add_generation_prompt: bool) -> list[int]: ...


class HFTokenizer:
    """A :class:`TrlTokenizer` over a ``transformers`` tokenizer, as TRL's ``_tokenize`` calls it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.eos_token = tokenizer, tokenizer.eos_token

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text=text)["input_ids"])

    def apply_chat(self, messages: Messages, add_generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                 add_generation_prompt=add_generation_prompt)
        return list(out["input_ids"])


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def is_conversational(row: dict[str, Any]) -> bool:
    """TRL's rule: one of the row's text fields is a list of messages."""
    keys = ("prompt", "chosen", "rejected", "completion", "messages")
    return any(_is_messages(row.get(k)) for k in keys)


def extract_prompt(row: dict[str, Any], where: str) -> dict[str, Any]:
    """TRL's ``extract_prompt``: ``{"prompt", "chosen", "rejected"}`` from an implicit-prompt pair (see
    the module doc; other fields kept). ValueError naming ``where`` when the two sides share no
    beginning, or are not both strings or both lists of messages."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    text = isinstance(chosen, str) and isinstance(rejected, str)
    if not (text or (_is_messages(chosen) and _is_messages(rejected))):
        raise ValueError(f"{where}: 'chosen' and 'rejected' must both be strings or both lists of messages")
    n = min(len(chosen), len(rejected))
    idx = n - 1  # TRL's loop index when the shorter side is a prefix of the other
    for i in range(n):
        if chosen[i] != rejected[i]:
            idx = i - 1 if i > 0 and chosen[i - 1] == " " else i  # the space goes with the completions
            break
    else:
        i = n
    if i == 0 or idx <= 0:
        what = "messages" if isinstance(chosen, list) else "text"
        raise ValueError(f"{where}: 'chosen' and 'rejected' share no beginning ({what}), so there is no implicit "
                         "prompt to extract: give the prompt as 'prompt', or make both sides start with the prompt "
                         "turns (TRL's implicit-prompt format)")
    return {**row, "prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def with_prompt(row: dict[str, Any], where: str) -> dict[str, Any]:
    """A preference row with its prompt: explicit as given, implicit extracted (:func:`extract_prompt`)."""
    return row if "prompt" in row else extract_prompt(row, where)


def unpair_rows(rows: Sequence[dict[str, Any]], block: int = UNPAIR_BLOCK) -> list[dict[str, Any]]:
    """Paired rows as KTO's unpaired rows, in TRL's order (``unpair_preference_dataset``): per block of
    ``block`` rows, each row's ``{"prompt", "completion": chosen, "label": True}`` then each row's
    ``{..., "completion": rejected, "label": False}``; other fields copied."""
    out: list[dict[str, Any]] = []
    for start in range(0, len(rows), block):
        part = rows[start:start + block]
        for side, label in (("chosen", True), ("rejected", False)):
            for r in part:
                rest = {k: v for k, v in r.items() if k not in ("chosen", "rejected")}
                out.append({**rest, "completion": r[side], "label": label})
    return out


def _with_eos(text: str, eos: str) -> str:
    return text if text.endswith(eos) else text + eos


def _tokens(prompt: Any, completion: Any, tok: TrlTokenizer, where: str) -> tuple[list[int], list[int]]:
    """``(tok(prompt), tok(prompt + completion))`` as TRL's ``_tokenize`` makes them."""
    if _is_messages(prompt) and _is_messages(completion):
        return tok.apply_chat(prompt, True), tok.apply_chat([*prompt, *completion], False)
    if isinstance(prompt, str) and isinstance(completion, str):
        return tok.encode(prompt), tok.encode(prompt + completion)
    raise ValueError(f"{where}: the prompt and its completion must both be strings or both lists of messages")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (TRL's ``common_prefix_length``)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokenize_prompt_completion(row: dict[str, Any], tok: TrlTokenizer, where: str) -> tuple[list[int], list[int]]:
    """``(prompt_ids, completion_ids)`` of a prompt-completion row as KTO's ``tokenize_fn`` makes them
    (a standard completion gets EOS first); SFT's ``input_ids`` are their concatenation, its
    ``completion_mask`` 1 on the completion."""
    completion = row["completion"]
    if isinstance(completion, str):
        completion = _with_eos(completion, tok.eos_token)
    prompt_ids, full = _tokens(row["prompt"], completion, tok, where)
    n = common_prefix(prompt_ids, full)
    return full[:n], full[n:]


def tokenize_pair(row: dict[str, Any], tok: TrlTokenizer, where: str) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, chosen_ids, rejected_ids)`` of a preference row (explicit or implicit prompt) as
    DPO's ``tokenize_fn`` makes them."""
    row = with_prompt(row, where)
    sides = [row["chosen"], row["rejected"]]
    if all(isinstance(s, str) for s in sides):
        sides = [_with_eos(s, tok.eos_token) for s in sides]
    (prompt_ids, chosen), (_, rejected) = (_tokens(row["prompt"], s, tok, where) for s in sides)
    n = min(common_prefix(prompt_ids, chosen), common_prefix(prompt_ids, rejected))
    return prompt_ids[:n], chosen[n:], rejected[n:]


def unpaired_rows(rows: Sequence[dict[str, Any]], where: Sequence[str]) -> list[dict[str, Any]]:
    """KTO's rows from a file's rows: unpaired rows (prompt, completion, label) as they are, paired
    ones (explicit or implicit prompt) unpaired in TRL's order (:func:`unpair_rows`). ValueError naming
    the row for a row that is neither, or a label that is not a bool."""
    paired = ["chosen" in r and "rejected" in r for r in rows]
    if any(paired) and not all(paired):
        i = paired.index(not paired[0])
        raise ValueError(f"{where[i]}: a file mixes paired (chosen / rejected) and unpaired (completion, label) rows")
    if rows and paired[0]:
        return unpair_rows([with_prompt(r, w) for r, w in zip(rows, where, strict=True)])
    for r, w in zip(rows, where, strict=True):
        missing = [k for k in ("prompt", "completion", "label") if k not in r]
        if missing:
            raise ValueError(f"{w}: an unpaired preference row needs 'prompt', 'completion' and 'label' (missing "
                             f"{missing}), or give 'chosen' and 'rejected'")
        if not isinstance(r["label"], bool):
            raise ValueError(f"{w}: 'label' must be true (desirable) or false, got {r['label']!r:.40}")
    return list(rows)


def kl_completions(completions: Sequence[Any], batch_size: int) -> list[Any]:
    """KTO's mismatched completions for its KL estimate (TRL's ``add_kl_completion_ids``): within each
    block of ``batch_size`` rows (TRL: ``per_device_train_batch_size``, the rows in data order), row i
    takes row i - 1's completion and the first row the block's last: ``(x1, y_n), (x2, y1), ...``."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: KTO rotates the completions within batches of at least 1 row")
    out: list[Any] = []
    for start in range(0, len(completions), batch_size):
        block = list(completions[start:start + batch_size])
        out += block[-1:] + block[:-1]
    return out
