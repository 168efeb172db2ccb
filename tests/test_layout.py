"""The layout by stage (docs/architecture.md): which subpackage may import which, no import
cycles between modules, the module paths of earlier releases, and every import the docs show."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from bridge._moved import MOVED

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "bridge"

# What each subpackage may import of bridge (docs/architecture.md). The engines → log
# pipeline is vllm → ingest → log; log → state is log → consume; ops is under everything,
# cli over everything.
ALLOWED = {
    "vllm": set(),
    "ops": set(),
    "log": {"vllm", "ops"},
    "ingest": {"vllm", "log", "ops"},
    "consume": {"vllm", "log", "ops"},
    "simulator": {"vllm", "ops"},
    "cli": {"vllm", "log", "ops", "ingest", "consume", "simulator", ""},
    "_moved": set(),
    "__main__": {"cli"},
    "": {"_moved"},  # bridge/__init__.py
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, whether at import time) for every import of ``bridge``; imports
    in functions (lazy) and under ``if TYPE_CHECKING`` are not at import time.
    ``from bridge.x import y`` counts as an import of ``bridge.x.y`` when that is a module."""
    tree = ast.parse(path.read_text())
    at_import = {
        id(node)
        for stmt in tree.body
        if not (isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test))
        for node in ast.walk(stmt)
        if not isinstance(stmt, ast.FunctionDef | ast.ClassDef)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            pytest.fail(f"{path}: relative import (the layout test reads absolute ones only)")
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "bridge":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((sub if sub in MODULES else node.module, id(node) in at_import))
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("bridge.")]
            out += [(name, id(node) in at_import) for name in names]
    return out


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_subpackages_import_only_what_the_architecture_allows():
    wrong = [
        f"{module} imports {target}"
        for module, path in MODULES.items()
        for target, _ in _imports(path)
        if _subpackage(target) != _subpackage(module)
        and _subpackage(target) not in ALLOWED[_subpackage(module)]
    ]
    assert not wrong, "\n".join(wrong)
    assert set(ALLOWED) >= {_subpackage(m) for m in MODULES}, "a subpackage without rules"


def test_no_module_imports_itself_through_others_at_import_time():
    graph = {
        m: {t for t, now in _imports(p) if now and t in MODULES and t != m}
        for m, p in MODULES.items()
    }
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    cycles = []
    for start in graph:  # a path back to start through other modules
        seen, todo = set(), [(start, (start,))]
        while todo:
            node, path = todo.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, (*path, nxt)))
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_module_paths_of_earlier_releases_still_import(old):
    module = importlib.import_module(old)
    new = MOVED[old]
    if isinstance(new, str):
        assert module is importlib.import_module(new)
    else:
        for part in map(importlib.import_module, new):
            public = [n for n in vars(part) if not n.startswith("_")]
            assert all(getattr(module, n) is not None for n in public)
        with pytest.raises(AttributeError, match="docs/architecture.md"):
            module.no_such_name  # noqa: B018


def _doc_names() -> set[str]:
    """``bridge...`` names the README and docs/ show: ``from X import a, b`` and dotted names."""
    found = set()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        for module, names in re.findall(r"from (bridge[\w.]*) import ([\w, ]+)", text):
            found |= {f"{module}.{n.strip()}" for n in names.split(",") if n.strip()}
        found |= set(re.findall(r"\bbridge(?:\.\w+)+", text))
    return found


DOC_NAMES = sorted(_doc_names())


def test_the_docs_name_bridge_objects():
    assert "bridge.consume.reader.TopicReader" in DOC_NAMES  # the scan itself works


@pytest.mark.parametrize("name", DOC_NAMES)
def test_every_name_the_docs_show_resolves(name):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"{name}: {'.'.join(parts[:cut])} has no {attr}"
            obj = getattr(obj, attr)
        return
    pytest.fail(f"{name}: no such module")
