"""Layers point down: no package of kd imports a package that imports it back.

A package is ``kd.<name>`` (a sub-package such as ``kd.teachers``, or a top-level module such as
``kd.losses``). Every import statement counts: at module level, inside functions and under
``if TYPE_CHECKING:``; a function-level import hides a dependency from the reader, not from this
test. Issue 36 found 8 such pairs (``teachers <-> training``, ``memory <-> training``,
``backends <-> checkpoint``, ...); 9 by this test's count, 0 since.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# What the runtime layer must never import (kd/runtime/__init__.py says so).
RUNTIME_BELOW = ("kd.teachers", "kd.training", "kd.recipes", "kd.cli", "kd.memory")


def modules(src: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``src``, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(src: Path, package: str) -> dict[tuple[str, str], list[str]]:
    """``(importing package, imported package) -> ["module:line", ...]`` over every import
    statement of ``package``'s modules (module level, in functions, under TYPE_CHECKING)."""
    mods = modules(src, package)

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join([*parts, base] if base else parts)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and "." in target and unit(target) != unit(name):
                    edges[(unit(name), unit(target))].append(f"{name}:{node.lineno}")
    return edges


def mutual_pairs(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """One line per pair of packages importing each other, naming an import each way."""
    lines = []
    for a, b in sorted(edges):
        if a < b and (b, a) in edges:
            lines.append(f"{a} <-> {b}: {edges[(a, b)][0]} and {edges[(b, a)][0]}")
    return lines


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The package cycles of any length (strongly connected components of two or more)."""
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph[b]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_package_of_kd_imports_a_package_that_imports_it_back() -> None:
    pairs = mutual_pairs(imports(SRC, "kd"))
    assert not pairs, "packages importing each other:\n" + "\n".join(pairs)


def test_the_packages_of_kd_form_no_cycle_of_any_length() -> None:
    assert cycles(imports(SRC, "kd")) == []


def test_the_runtime_layer_imports_nothing_above_it() -> None:
    edges = imports(SRC, "kd")
    up = [f"{a} -> {b}: {where}" for (a, b), where in edges.items() if a == "kd.runtime"]
    assert [line for line in up if line.split(" -> ")[1].split(":")[0] in RUNTIME_BELOW] == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    ("hidden", "where"),
    [
        ("from pkg.a.x import f", "module level"),
        ("def g():\n    from pkg.a import x\n", "in a function"),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a.x\n",
            "under TYPE_CHECKING",
        ),
        ("def g():\n    from ..a import x\n", "relative, in a function"),
    ],
)
def test_the_check_finds_a_pair_however_the_import_is_written(
    tmp_path: Path, hidden: str, where: str
) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "",
            "pkg/a/x.py": "from pkg.b.y import h\n",
            "pkg/b/__init__.py": "",
            "pkg/b/y.py": hidden + "\n",
            "pkg/c.py": "import pkg.b\n",
        },
    )
    edges = imports(tmp_path, "pkg")
    pairs = mutual_pairs(edges)
    assert len(pairs) == 1 and pairs[0].startswith("pkg.a <-> pkg.b: pkg.a.x:1 and pkg.b.y:"), where
    assert cycles(edges) == [["pkg.a", "pkg.b"]]


def test_the_check_finds_a_cycle_of_three(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import pkg.b\n",
            "pkg/b.py": "def f():\n    import pkg.c\n",
            "pkg/c.py": "from pkg import a\n",
        },
    )
    edges = imports(tmp_path, "pkg")
    assert mutual_pairs(edges) == []
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.c"]]
