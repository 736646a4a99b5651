"""The README is a landing page (issue 45): at most 200 lines, and it still holds what a newcomer
needs first -- the two commands as its first code block, the ten-line API (which
tests/docs/test_code_blocks.py runs on 4 ranks) and links into the docs that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
COMMANDS = ("make train   # set-up + the main job: `seqpar train` on its embedded default (about 2 minutes, "
            "2 CPU cores)\nmake test    # set-up + the whole test suite (CPU only, no GPU needed)\n")


def _first_code_block(text: str) -> str:
    start = text.index("```")
    body = text.index("\n", start) + 1
    return text[body:text.index("```", body)]


def _api_block() -> list[str]:
    section = README[README.index("## The Python API in ten lines"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```", start)].splitlines()


def test_at_most_200_lines():
    assert len(README.splitlines()) <= 200, len(README.splitlines())


def test_the_two_commands_are_the_first_code_block():
    assert _first_code_block(README) == COMMANDS


def test_the_api_in_ten_lines_stays_short_and_complete():
    lines = [line for line in _api_block() if line.strip()]
    assert len(lines) <= 13, lines  # no longer than the block under this heading has been (two imports, eleven lines)
    code = "\n".join(lines)
    for call in ("seqpar.init_mesh(", "seqpar.parallelize(", "seqpar.shard_batch(", ".loss", ".backward()",
                 "seqpar.sync_gradients(", "optimizer.step()"):
        assert call in code, call


def test_every_relative_link_exists():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert len(local) >= 15, local  # the guides, the benchmarks, the architecture, the reference, the changelog
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing
    for page in ("docs/guides/quickstart.md", "docs/benchmarks.md", "docs/architecture.md", "CHANGELOG.md",
                 "docs/assets/memory_vs_p.png"):
        assert page in local, page
