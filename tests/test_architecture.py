"""The package's shape, read from its source (pure AST, nothing imported): no import circle between
modules, no private name (``_x``) taken from another module, a sorted ``__all__`` whose names all
resolve, and every dotted ``seqpar.x.y`` name that a docstring, the README, the changelog or a docs page
mentions resolves.

Import-linter's layer contract (``lint-imports``) keeps the arrows between layers pointing down; it
cannot see a circle inside one layer (integrations' hf <-> memory) or a private name, hence this."""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "seqpar"


@cache
def modules() -> dict[str, Path]:
    """Every module under src/seqpar by dotted name (a package by its own name, not ``.__init__``)."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text(), filename=str(modules()[name]))


def _base(name: str, node: ast.ImportFrom) -> str:
    """The absolute module of ``from <...> import``, resolving relative imports."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if modules()[name].name == "__init__.py" else name.split(".")[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def imports(name: str) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every import of a seqpar module in ``name``:
    at the top, inside functions and under ``TYPE_CHECKING`` alike (each is a dependency of the
    code). ``from pkg import sub`` names the submodule ``pkg.sub`` when it is one."""
    known = modules()
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            base = _base(name, node)
            if base.split(".")[0] != PACKAGE:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None, node.lineno) if sub in known else (base, a.name, node.lineno))
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {}
    for name in known:
        targets = set()
        for target, _, _ in imports(name):
            while target not in known and "." in target:  # `import seqpar.a.b.C`-style: the module part
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def private_imports() -> list[str]:
    """``module:line imports other._name`` for every private name one module takes from another:
    ``from .other import _name``, and ``other._name`` on a module it imported as ``other``."""
    known = modules()
    found = []
    for name in known:
        aliases: dict[str, str] = {}  # a local name bound to another seqpar module
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known and a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    sub = f"{_base(name, node)}.{a.name}"
                    if sub in known:
                        aliases[a.asname or a.name] = sub
        for target, what, line in imports(name):
            if what is not None and _private(what) and target != name:
                found.append(f"{name}:{line} imports {target}.{what}")
        for node in ast.walk(tree(name)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and _private(node.attr) and aliases[node.value.id] != name):
                found.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_the_analysis_sees_circles_and_private_names():
    """The checks below are only as good as this reader: a circle and a private import it must see."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    names = {m for m in modules()}
    assert {"seqpar", "seqpar.integrations.hf.parallelize", "seqpar.cli.main"} <= names
    assert "seqpar.integrations.hf.kernel" in import_graph()["seqpar.integrations.hf.parallelize"]
    assert _private("_ATTR") and _private("_num") and not _private("__version__") and not _private("plan")


def test_no_import_circle_between_modules():
    found = cycles(import_graph())
    assert not found, f"import circles (modules importing each other, directly or around a loop): {found}"


def test_no_private_name_imported_across_modules():
    found = private_imports()
    assert not found, "private names taken from another module (make them public or move them):\n" + "\n".join(found)


# --------------------------------------------------------------------------------------------
# the public surface
# --------------------------------------------------------------------------------------------

def test_all_is_sorted_and_every_name_resolves():
    import seqpar

    assert seqpar.__all__ == sorted(seqpar.__all__), "keep seqpar.__all__ sorted"
    assert len(set(seqpar.__all__)) == len(seqpar.__all__)
    missing = [n for n in seqpar.__all__ if not hasattr(seqpar, n)]
    assert not missing, missing


def _readme_api_example() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## The Python API in ten lines")
    return text[start:text.index("```", text.index("```python", start) + 9)]


def test_all_covers_what_the_readme_calls_on_seqpar():
    """Every ``seqpar.name(...)`` of the README (its API example first) is in ``__all__``. The example's
    one other import, ``seqpar.integrations.models.build_model``, stays out of it on purpose: it builds
    seqpar's own tiny demo configs (``"tiny-llama"``), where a user brings a transformers model; like
    every internal it is imported from its module, as the example does."""
    import seqpar

    readme = (ROOT / "README.md").read_text()
    example = _readme_api_example()
    example_calls = set(re.findall(r"\bseqpar\.([A-Za-z_]\w*)\(", example))
    assert example_calls >= {"init_mesh", "parallelize", "reduce_memory", "shard_batch", "sync_gradients"}
    called = set(re.findall(r"(?<![\w.])seqpar\.([A-Za-z_]\w*)", readme))
    packages = {n for n in called if f"seqpar.{n}" in modules()}
    assert not (called - packages) - set(seqpar.__all__), (called - packages) - set(seqpar.__all__)
    imported = re.findall(r"from (seqpar[\w.]*) import ([\w, ]+)", example)
    assert imported == [("seqpar.integrations.models", "build_model")], imported
    for module, names in imported:
        for n in (x.strip() for x in names.split(",")):
            assert callable(getattr(importlib.import_module(module), n)), n


_DOTTED = re.compile(r"(?<![\w.])seqpar(?:\.[A-Za-z_]\w*)+")


def _docstrings(name: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree(name)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((getattr(node, "lineno", 1), doc))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.append((node.lineno, node.value.value))  # attribute docstrings (a string after an assignment)
    return out


def _resolves(dotted: str) -> bool:
    """Whether ``seqpar.a.b.c`` names something: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def prose_pages() -> list[Path]:
    """The README, the changelog and every page of the docs site (docs/**/*.md)."""
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def dotted_mentions() -> list[tuple[str, str]]:
    """``(where, seqpar.x.y)`` for every dotted name in a docstring under src/seqpar and in the prose
    pages (a trailing sentence dot is not part of the name; ``seqpar.x.py`` is not a name either)."""
    found = []
    for name in modules():
        for line, doc in _docstrings(name):
            found += [(f"{name}:{line}", m.group(0)) for m in _DOTTED.finditer(doc)]
    for page in prose_pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            found += [(f"{page.relative_to(ROOT)}:{number}", m.group(0)) for m in _DOTTED.finditer(line)]
    return [(w, d) for w, d in found if not d.endswith(".py")]


def test_every_dotted_seqpar_name_in_docstrings_and_the_docs_resolves():
    mentions = dotted_mentions()
    pages = {where.split(":")[0] for where, _ in mentions if where.endswith(".md") or ".md:" in where}
    assert len(mentions) > 50  # the reader found them (the docs alone have dozens)
    assert {"README.md", "CHANGELOG.md", "docs/guides/dynamic-sp.md", "docs/reference/objectives.md"} <= pages
    stale = sorted({f"{where}: {dotted}" for where, dotted in mentions if not _resolves(dotted)})
    assert not stale, "names that do not resolve:\n" + "\n".join(stale)


@pytest.mark.parametrize("dotted, ok", [("seqpar.plan", True), ("seqpar.comm.mesh.init_mesh", True),
                                        ("seqpar.ring_comm", False), ("seqpar.comm.mesh.nothing", False)])
def test_the_resolver(dotted, ok):
    assert _resolves(dotted) is ok


_RELATIVE_ROLE = re.compile(r":(?:mod|func|class|meth|data|attr|exc):`~?(\.[\w.]+)`")


def relative_role_targets() -> list[tuple[str, str]]:
    """``(where, absolute name)`` for every Sphinx role with a relative target (``:mod:`.x```) in a
    module's source, resolved against the module's package as Python resolves ``from .x import``."""
    found = []
    for name, path in modules().items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        text = path.read_text()
        for m in _RELATIVE_ROLE.finditer(text):
            ref = m.group(1)
            dots = len(ref) - len(ref.lstrip("."))
            target = ".".join(package[:len(package) - dots + 1] + [ref.lstrip(".")])
            found.append((f"{name}:{text[:m.start()].count(chr(10)) + 1}", target))
    return found


def test_every_relative_role_in_a_docstring_resolves():
    """A module moved into a subpackage leaves its ``:mod:`.sibling``` references pointing nowhere."""
    found = relative_role_targets()
    assert len(found) > 50
    stale = sorted(f"{where}: {target}" for where, target in found if not _resolves(target))
    assert not stale, "relative references that do not resolve:\n" + "\n".join(stale)
