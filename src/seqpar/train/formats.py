"""``--data`` files read by what they are, into records: plain text, a chat, or a prompt and completion.

    file                              read as
    *.jsonl, *.json                   one JSON object per line (a *.json holding one JSON array: its
                                      objects); each object is a record (below)
    *.parquet, *.arrow                through the ``datasets`` library (local files only); each row is
                                      a record; an *.arrow shard of ``datasets.save_to_disk`` too
    a ``save_to_disk`` directory      ``datasets.load_from_disk`` (a DatasetDict: its "train" split)
    any other file                    one plain-text document, if it is UTF-8 text; a binary file
                                      (a NUL byte, or not UTF-8) is refused

An object or row is a record by its fields, in this order:

    "messages": [{"role", "content"}, ...]           chat (roles: system, developer, user, assistant, tool)
    "prompt" and "completion" (strings, or messages)  prompt / completion
    "prompt", "chosen" and "rejected" (strings, or    a preference pair (TRL's standard and conversational
    messages)                                         preference formats, explicit prompt)
    "chosen" and "rejected" only                      a preference pair with an implicit prompt: their
                                                      shared beginning, extracted as TRL does
    --text-field (default "text"): a string          plain text (a list of messages there: chat)

Everything here is pure (no processes, no tokenizer): the parent reads the files before any worker
starts, so a bad file is one clear error naming the file and line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from seqpar.objectives.trl_formats import with_prompt

JSON_EXTS = (".jsonl", ".json")
DATASETS_EXTS = (".parquet", ".arrow")
ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT, CHAT, PROMPT_COMPLETION, PREFERENCE = "text", "chat", "prompt/completion", "preference"
FORMATS_HELP = ("*.txt and any other UTF-8 file: one plain-text document; *.jsonl / *.json: one JSON object per "
                "line (or a JSON array); *.parquet, *.arrow and datasets.save_to_disk directories: read with the "
                "datasets library; each object or row is chat ('messages': [{role, content}, ...]), prompt / "
                "completion ('prompt', 'completion'), a preference pair ('prompt', 'chosen', 'rejected') or text "
                "(--text-field); binary files are refused")


@dataclass(frozen=True)
class Record:
    """One document before tokenization. ``kind``: TEXT (``text``), CHAT (``messages``),
    PROMPT_COMPLETION (``prompt`` and ``completion``: both strings, or both lists of messages) or
    PREFERENCE (``prompt``, ``chosen`` and ``rejected``: all strings, or all lists of messages);
    ``where``: ``file:line`` or ``file[row]``, for error messages."""

    kind: str
    where: str
    text: str = ""
    messages: tuple[dict[str, str], ...] = ()
    prompt: Any = None
    completion: Any = None
    chosen: Any = None
    rejected: Any = None


def _check_messages(messages: Any, where: str, field: str) -> tuple[dict[str, str], ...]:
    """The messages of a chat as plain dicts; ValueError naming the record and message at fault."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: {field!r} must be a non-empty list of {{'role', 'content'}} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: {field}[{i}] must be an object with 'role' and 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: {field}[{i}] has role {m['role']!r}; the roles a chat template knows are "
                             f"{', '.join(ROLES)}: rename it in the data")
        if not isinstance(m["content"], str):
            raise ValueError(f"{where}: {field}[{i}] content must be a string, got {type(m['content']).__name__}")
        out.append(dict(m))
    return tuple(out)


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def to_record(obj: Any, where: str, text_field: str) -> Record:
    """The record one JSON object or dataset row stands for (see the module docstring)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        return Record(CHAT, where, messages=_check_messages(obj["messages"], where, "messages"))
    if "chosen" in obj and "rejected" in obj:
        return _preference(obj, where)
    if "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return Record(PROMPT_COMPLETION, where, prompt=prompt, completion=completion)
        if _is_messages(prompt) and _is_messages(completion):
            return Record(PROMPT_COMPLETION, where, prompt=_check_messages(prompt, where, "prompt"),
                          completion=_check_messages(completion, where, "completion"))
        raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages")
    if text_field not in obj:
        raise ValueError(f"{where}: no {text_field!r} field (found {list(obj)}); set --text-field to the field that "
                         "holds the text, or give 'messages' (chat) or 'prompt' and 'completion'")
    value = obj[text_field]
    if _is_messages(value):
        return Record(CHAT, where, messages=_check_messages(value, where, text_field))
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {text_field!r} must be a string (or a list of chat messages), got "
                         f"{type(value).__name__}")
    return Record(TEXT, where, text=value)


def _preference(obj: dict[str, Any], where: str) -> Record:
    """A prompt / chosen / rejected record: all strings, or all lists of messages. Without "prompt"
    (TRL's implicit-prompt format) the prompt is the two sides' shared beginning, as TRL extracts it."""
    obj = with_prompt(obj, where)  # ValueError naming the row when the two share no beginning
    parts = {k: obj[k] for k in ("prompt", "chosen", "rejected")}
    if all(isinstance(v, str) for v in parts.values()):
        return Record(PREFERENCE, where, **parts)
    if all(_is_messages(v) for v in parts.values()):
        return Record(PREFERENCE, where, **{k: _check_messages(v, where, k) for k, v in parts.items()})
    raise ValueError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings or all lists of messages")


def _text_file(path: str) -> str:
    """A plain-text file's content; ValueError for a binary one (a NUL byte, or not UTF-8)."""
    with open(path, "rb") as f:
        raw = f.read()
    hint = ("seqpar reads plain text only from UTF-8 files; give parquet as *.parquet, arrow as *.arrow, a "
            "datasets.save_to_disk directory as the directory")
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise ValueError(f"--data {path!r} is a binary file (a NUL byte at offset {nul}), not text: {hint}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path!r} is not UTF-8 text (byte {e.start}): {hint}") from None


def _json_objects(path: str, content: str) -> Iterator[tuple[str, Any]]:
    """``(where, object)`` of a *.jsonl / *.json file's content."""
    if path.lower().endswith(".json") and content.lstrip().startswith("["):  # one JSON array of objects
        try:
            items = json.loads(content)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        for i, obj in enumerate(items):
            yield f"{path}[{i}]", obj
        return
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        yield f"{path}:{lineno}", obj


def is_saved_dataset(path: str) -> bool:
    """A directory written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("state.json", "dataset_dict.json"))


def _dataset(path: str) -> Any:
    """A ``datasets.Dataset`` from a local parquet / arrow file or save_to_disk directory."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("datasets") is None:
        raise ValueError(f"--data {path!r} is read with the datasets library: pip install 'seqpar[data]' (or pip "
                         "install datasets)")

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never the Hub
    import datasets
    from datasets.utils import logging as ds_logging

    shown = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        if os.path.isdir(path):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ValueError(f"--data {path!r} holds the splits {list(ds)} and no 'train': give one split's "
                                     f"directory, e.g. {os.path.join(path, next(iter(ds)))}")
                ds = ds["train"]
            return ds
        if path.lower().endswith(".arrow"):
            return datasets.Dataset.from_file(path)
        with tempfile.TemporaryDirectory(prefix="seqpar-parquet-") as cache:  # no cache left behind
            return datasets.Dataset.from_parquet(path, keep_in_memory=True, cache_dir=cache)
    except ValueError:
        raise
    except Exception as e:  # pyarrow / datasets errors: their text says what is wrong with the file
        raise ValueError(f"--data {path!r} cannot be read by the datasets library: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None
    finally:
        if shown:
            ds_logging.enable_progress_bar()


def _dataset_rows(path: str, columns_for: str = "", text_field: str = "text") -> Iterator[tuple[str, Any]]:
    """``(where, row)`` of a parquet / arrow file or save_to_disk directory. ``columns_for="records"``:
    refuse a dataset none of whose columns makes a record (before reading a row)."""
    ds = _dataset(path)
    columns = list(ds.column_names)
    if columns_for == "records" and ("messages" not in columns and not {"prompt", "completion"} <= set(columns)
                                     and not {"chosen", "rejected"} <= set(columns) and text_field not in columns):
        raise ValueError(f"--data {path!r} has no {text_field!r} column (columns: {columns}); set --text-field to the "
                         "column that holds the text, or give 'messages' (chat), 'prompt' and 'completion', or "
                         "'prompt', 'chosen' and 'rejected' (preference pairs)")
    for i, row in enumerate(ds):
        yield f"{path}[{i}]", row


def read_rows(paths: Sequence[str]) -> list[tuple[str, Any]]:
    """``(where, object)`` of every JSON object (*.jsonl / *.json) or dataset row (parquet, arrow,
    save_to_disk) of ``paths``, in order, before any reading as records: for data whose rows are not
    documents (RL rollouts). ValueError naming the file at fault (plain-text files too)."""
    if not paths:
        raise ValueError("--data needs at least one file")
    out: list[tuple[str, Any]] = []
    for path in paths:
        if not os.path.exists(path):
            raise ValueError(f"--data {path!r}: no such file")
        if is_saved_dataset(path) or path.lower().endswith(DATASETS_EXTS):
            rows = list(_dataset_rows(path))
        elif path.lower().endswith(JSON_EXTS):
            content = _text_file(path)
            rows = list(_json_objects(path, content))
        else:
            raise ValueError(f"--data {path!r}: rows are read from *.jsonl / *.json objects or parquet / arrow / "
                             "save_to_disk datasets, not from plain text")
        if not rows:
            raise ValueError(f"--data {path!r} holds no rows")
        out += rows
    return out


def read_file(path: str, text_field: str = "text") -> list[Record]:
    """The records of one ``--data`` path (see the module docstring). ValueError naming the file
    (and line or row) at fault."""
    if not os.path.exists(path):
        raise ValueError(f"--data {path!r}: no such file")
    if is_saved_dataset(path):
        records = [to_record(row, where, text_field) for where, row in _dataset_rows(path, "records", text_field)]
    elif os.path.isdir(path):
        raise ValueError(f"--data {path!r} is a directory: give the files in it (e.g. {path}/*.jsonl), or a "
                         "datasets.save_to_disk directory")
    elif path.lower().endswith(DATASETS_EXTS):
        records = [to_record(row, where, text_field) for where, row in _dataset_rows(path, "records", text_field)]
    else:
        content = _text_file(path)
        if not content.strip():
            raise ValueError(f"--data {path!r} is empty")
        if path.lower().endswith(JSON_EXTS):
            records = [to_record(obj, where, text_field) for where, obj in _json_objects(path, content)]
        else:
            records = [Record(TEXT, path, text=content)]
    if not records:
        raise ValueError(f"--data {path!r} holds no documents")
    return records


def read_records(paths: Sequence[str], text_field: str = "text") -> list[Record]:
    """The records of every ``--data`` path, in order. Raises ValueError naming the file at fault."""
    if not paths:
        raise ValueError("--data needs at least one file")
    return [r for path in paths for r in read_file(path, text_field)]


def count_kinds(records: Sequence[Record]) -> dict[str, int]:
    """How many records of each kind, in the order TEXT, CHAT, PROMPT_COMPLETION, PREFERENCE (kinds present only)."""
    counts = {k: sum(r.kind == k for r in records) for k in (TEXT, CHAT, PROMPT_COMPLETION, PREFERENCE)}
    return {k: n for k, n in counts.items() if n}
