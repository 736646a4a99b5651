"""Every code block of the docs (docs/**/*.md) and the README runs here, as the page shows it.

A page's ``python`` blocks run in a fresh namespace each (a block marked ``continue`` goes on in the
previous one's); those marked ``world=N`` run on N gloo ranks (``seqpar.comm.launch.run_distributed``:
the test starts the process group, so a script's own ``init_process_group()`` / ``destroy_process_group()``
are torchrun's part and do nothing here), all the blocks of one world size in one start. ``bash``
blocks whose commands are all ``seqpar ...`` run as they stand in a fresh directory (``files=NAME``:
with the files tests/docs/doc_files.py makes; ``examples/`` is the repository's). A block marked
``syntax-only`` (a GPU, many processes, a checkpoint of your own) is compiled, or checked with
``bash -n``; any other block that is not runnable fails here until it is marked. Marks: see
tests/docs/markdown_blocks.py. ``heavy`` blocks run under ``pytest -m heavy`` (make verify).
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
from doc_files import FILES
from markdown_blocks import CODE_LANGS, Block, blocks, pages, runnable_shell, shell_commands

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

GIVEN = {
    # the README's loop reads `loader`: one batch of two rows of 37 tokens (tiny-llama's vocabulary)
    "loader": ("import torch\n"
               "_ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(0))\n"
               "loader = [{'input_ids': _ids, 'labels': _ids.clone()}]\n"),
    # the N-D guide's tensor-parallel loop: a tiny Llama (KV heads 2 < tp x sp) and one batch of two rows
    "llama": ("import torch\n"
              "from seqpar.integrations.models import build_model\n"
              "torch.manual_seed(0)\n"
              "model, _ = build_model('tiny-llama')\n"
              "_ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(0))\n"
              "batch = {'input_ids': _ids, 'labels': _ids.clone()}\n"),
    # the expert-parallelism guide's loop: a tiny Qwen3-MoE (4 experts, eager experts) and one batch
    "moe": ("import torch, transformers\n"
            "torch.manual_seed(0)\n"
            "model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(\n"
            "    vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,\n"
            "    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,\n"
            "    experts_implementation='eager'))\n"
            "_ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(0))\n"
            "batch = {'input_ids': _ids, 'labels': _ids.clone()}\n"),
    # the diffusers guide's calls: a tiny Wan (float64) and the same whole inputs on every rank
    "wan": ("import torch\n"
            "from seqpar.testing.diffusers_zoo import build_dit\n"
            "transformer = build_dit('WanTransformer3DModel')\n"
            "_g = torch.Generator().manual_seed(0)\n"
            "x0 = torch.randn(2, 4, 3, 2, 10, generator=_g, dtype=torch.float64)\n"
            "noise = torch.randn(x0.shape, generator=_g, dtype=torch.float64)\n"
            "text = torch.randn(2, 7, 16, generator=_g, dtype=torch.float64)\n"
            "t = torch.tensor([300.0, 700.0], dtype=torch.float64)\n"
            "x_t = (1 - t / 1000).view(-1, 1, 1, 1, 1) * x0 + (t / 1000).view(-1, 1, 1, 1, 1) * noise\n"),
}
"""Code a block marked ``given=NAME`` runs after (what the page leaves to the reader, e.g. a loader)."""


def _collect() -> list[Block]:
    found = []
    for path in [*pages(ROOT / "docs"), ROOT / "README.md"]:
        found += [b for b in blocks(path.read_text(), str(path.relative_to(ROOT))) if b.lang in CODE_LANGS]
    return found


ALL = _collect()


def _groups() -> list[list[Block]]:
    """Python blocks grouped: a ``continue`` block joins the group of its page's previous python block."""
    out: list[list[Block]] = []
    for b in (b for b in ALL if b.lang == "python" and not b.syntax_only):
        if "continue" in b.marks:
            assert out and out[-1][0].page == b.page, f"{b.id}: 'continue' with no python block before it"
            out[-1].append(b)
        else:
            out.append([b])
    return out


GROUPS = _groups()


def _source(group: list[Block]) -> str:
    given = group[0].marks.get("given")
    return (GIVEN[given] if given else "") + "".join(b.code for b in group)


def _heavy(group: list[Block]) -> bool:
    return any("heavy" in b.marks for b in group)


def _param(item: Block | list[Block]) -> pytest.param:
    first = item[0] if isinstance(item, list) else item
    heavy = _heavy(item) if isinstance(item, list) else "heavy" in item.marks
    return pytest.param(item, id=first.id, marks=[pytest.mark.heavy] if heavy else [])


def _exec(code: str, name: str) -> None:
    exec(compile(code, name, "exec"), {"__name__": "__docs__"})  # noqa: S102 -- the docs' own code


def _rank_groups(rank: int, world: int, groups: list[tuple[str, str]]) -> dict[str, str | None]:
    """On each rank: every group in a fresh namespace; its traceback, or None. A group that runs
    alone (it stops ranks on purpose) ends the processes without the barrier between groups."""
    import torch.distributed as dist

    dist.init_process_group = lambda *a, **k: None  # the group exists: torchrun's part is done
    dist.destroy_process_group = lambda *a, **k: None  # run_distributed ends it
    out: dict[str, str | None] = {}
    for name, code in groups:
        try:
            _exec(code, name)
            out[name] = None
        except Exception:
            out[name] = traceback.format_exc()
        if len(groups) > 1:
            dist.barrier()
    return out


def _alone(group: list[Block]) -> str:
    return group[0].id if "alone" in group[0].marks else ""


@cache
def _launch(world: int, heavy: bool, alone: str) -> dict[str, list[str | None]]:
    """Every group of this world size (and heaviness) in one start, or the one ``alone`` group:
    ``{group id: [error per rank]}``."""
    from seqpar.comm.launch import run_distributed

    chosen = [g for g in GROUPS if g[0].world == world and _heavy(g) == heavy and _alone(g) == alone]
    per_rank = run_distributed(_rank_groups, world, [(g[0].id, _source(g)) for g in chosen], timeout=900,
                               pg_timeout=120)
    return {g[0].id: [r[g[0].id] for r in per_rank] for g in chosen}


@pytest.mark.parametrize("group", [_param(g) for g in GROUPS])
def test_python_block_runs(group: list[Block]) -> None:
    if group[0].world:
        errors = _launch(group[0].world, _heavy(group), _alone(group))[group[0].id]
        failed = {r: e for r, e in enumerate(errors) if e}
        assert not failed, "\n".join(f"--- rank {r} ---\n{e}" for r, e in failed.items())
    else:
        _exec(_source(group), group[0].id)


def _run_seqpar(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "seqpar.cli.main", *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


SHELL = [b for b in ALL if b.lang == "bash" and not b.syntax_only]


@pytest.mark.parametrize("block", [_param(b) for b in SHELL])
def test_seqpar_command_block_runs(block: Block, tmp_path: Path) -> None:
    assert runnable_shell(block.code), (f"{block.id}: a bash block whose commands are not all `seqpar ...`: "
                                        "mark it <!-- test: syntax-only, REASON -->")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    prepare: Callable[[Path], None] | None = FILES.get(block.marks.get("files", ""))
    if "files" in block.marks:
        assert prepare is not None, f"{block.id}: unknown files={block.marks['files']!r} (known: {sorted(FILES)})"
        prepare(tmp_path)
    for argv in shell_commands(block.code):
        p = _run_seqpar(argv, tmp_path)
        assert p.returncode == 0, f"{' '.join(argv)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in ALL if b.syntax_only])
def test_syntax_only_block_parses(block: Block) -> None:
    assert block.reason
    if block.lang == "python":
        compile(block.code, block.id, "exec")
    else:
        p = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr


def test_the_collector_sees_marks_and_groups() -> None:
    """The reader the tests above rely on: marks, continuation, dedented list-item fences, commands."""
    page = ("<!-- test: world=2 -->\n```python\nx = 1\n```\n\n<!-- test: continue -->\n```python\ny = x\n```\n"
            "- a list item:\n\n  <!-- test: syntax-only, needs a GPU -->\n  ```bash\n  torchrun x.py \\\n"
            "      --a 1   # why\n  ```\n")
    found = blocks(page, "p.md")
    assert [(b.lang, b.line, b.world, b.syntax_only) for b in found] == [
        ("python", 2, 2, False), ("python", 7, 0, False), ("bash", 13, 0, True)]
    assert found[1].marks == {"continue": ""} and found[2].reason == "needs a GPU"
    assert shell_commands(found[2].code) == [["torchrun", "x.py", "--a", "1"]]
    assert runnable_shell("seqpar plan --heads 8 \\\n  --world-size 8\n") and not runnable_shell("pip install x\n")
    with pytest.raises(ValueError, match="unknown test mark"):
        blocks("<!-- test: wrold=2 -->\n```python\n```\n", "p.md")
    with pytest.raises(ValueError, match="needs a reason"):
        blocks("<!-- test: syntax-only -->\n```bash\n```\n", "p.md")
    assert len(ALL) >= 20 and any(b.page == "README.md" for b in ALL)
