"""The fenced code blocks of a Markdown page, with the test marks written above them (pure).

A block's mark is an HTML comment on the line just before its fence (Markdown renders nothing)::

    <!-- test: world=2 -->              run on 2 gloo ranks (each rank its own fresh namespace)
    <!-- test: continue -->             run after the page's previous python block, in its namespace
    <!-- test: given=loader -->         run after the named given code (tests/docs/test_code_blocks.py)
    <!-- test: files=chat -->           (bash) run where the named files exist (tests/docs/doc_files.py)
    <!-- test: alone -->                (python, world=N) in processes of its own (a block that stops ranks)
    <!-- test: heavy -->                run under ``pytest -m heavy`` (make verify) only
    <!-- test: syntax-only, REASON -->  compiled (python) or ``bash -n`` (bash) only; REASON says why

Tokens before the comma are the directives; ``syntax-only`` needs a reason after it. A block with no
mark is run: python in one process, bash when every command in it is ``seqpar ...``.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>```+)(?P<lang>[\w+-]*)[ \t]*$")
MARK = re.compile(r"^\s*<!--\s*test:(?P<body>.*?)-->\s*$")
KNOWN = {"world", "continue", "given", "files", "heavy", "alone", "syntax-only"}
CODE_LANGS = {"python", "bash"}


@dataclass
class Block:
    """One fenced block: where it is, its language, its code (dedented) and its mark."""

    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marks: dict[str, str] = field(default_factory=dict)
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def world(self) -> int:
        return int(self.marks.get("world", "0"))

    @property
    def syntax_only(self) -> bool:
        return "syntax-only" in self.marks


def parse_mark(text: str) -> tuple[dict[str, str], str]:
    """``"world=2 heavy, why"`` -> ``({"world": "2", "heavy": ""}, "why")``; unknown directives raise."""
    head, _, reason = text.partition(",")
    marks = {}
    for token in head.split():
        key, _, value = token.partition("=")
        if key not in KNOWN:
            raise ValueError(f"unknown test mark {key!r} (known: {sorted(KNOWN)})")
        marks[key] = value
    if "syntax-only" in marks and not reason.strip():
        raise ValueError("a syntax-only mark needs a reason after a comma: <!-- test: syntax-only, needs a GPU -->")
    return marks, reason.strip()


def blocks(text: str, page: str) -> list[Block]:
    """Every fenced block of ``text`` (a Markdown page) in order, marks attached."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent, ticks = i, m["indent"], m["ticks"]
        body = []
        i += 1
        while i < len(lines) and not (lines[i].strip() == ticks and lines[i].startswith(indent)):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start + 1}: a fence that never closes")
        i += 1
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        mark = MARK.match(lines[prev]) if prev >= 0 else None
        marks, reason = parse_mark(mark["body"]) if mark else ({}, "")
        out.append(Block(page, start + 1, m["lang"], textwrap.dedent("\n".join(body)) + "\n", marks, reason))
    return out


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, split like the shell."""
    joined = re.sub(r"\\\n", " ", code)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def runnable_shell(code: str) -> bool:
    """Whether every command of a bash block is ``seqpar ...`` (what the tests run as they stand)."""
    commands = shell_commands(code)
    return bool(commands) and all(argv[0] == "seqpar" for argv in commands)


def pages(root: Path) -> list[Path]:
    """The guides' pages: every Markdown file under ``root`` (docs/)."""
    return sorted(root.rglob("*.md"))
