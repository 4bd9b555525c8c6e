"""The import graph of dora, read from its sources: no cycle among its modules, and no import that
climbs a level of the `layers` contract in pyproject.toml.

`lint-imports` checks the contracts on the graph it builds itself; this test reads the imports
with `ast` so that a cycle is named module by module, whether or not a contract covers the two
packages involved. Every import counts, at module level or inside a function (a function-level
import runs as soon as the function does), except those under `if TYPE_CHECKING:`, which never
run. Importing `a.b.c` also runs the `__init__` of `a.b`; that edge is not drawn, since a package
re-exporting its own modules would otherwise be a cycle with each of them.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import dora

ROOT = Path(dora.__file__).resolve().parent


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST, package: str) -> Iterator[str]:
    """Every name an import statement of `tree` reaches for, skipping `if TYPE_CHECKING:` bodies
    (their `else:` runs)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield from _imported(ast.Module(body=[child], type_ignores=[]), package)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            # `from a import b`: the module a.b if there is one, else a (resolved by the caller)
            yield from (
                base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names
            )
        yield from _imported(node, package)


def import_graph(root: Path) -> dict[str, set[str]]:
    """`module -> modules of the same package tree it imports`, for every module under `root`."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for target in _imported(ast.parse(path.read_text(), str(path)), package):
            while target and target not in paths:  # `from a.b import name`: the module a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def levels() -> dict[str, int]:
    """`top-level module -> its level` from the `layers` contract (0 is the top)."""
    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return {
        name.strip(): i
        for i, layer in enumerate(contract["layers"])
        for name in layer.replace(":", "|").split("|")
    }


def climbs(graph: dict[str, set[str]], level: dict[str, int]) -> list[str]:
    """Imports from one top-level module into another on its own level or one above it."""
    top = lambda name: ".".join(name.split(".")[:2])  # noqa: E731
    bad = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = top(source), top(target)
            if a != b and "." in a and "." in b and level[b] <= level[a]:
                bad.append(f"{source} -> {target} (level {level[a]} imports level {level[b]})")
    return bad


def test_no_import_cycle_among_dora_modules() -> None:
    assert cycles(import_graph(ROOT)) == []


def test_no_import_climbs_a_level() -> None:
    assert climbs(import_graph(ROOT), levels()) == []


# --- the reader itself, on a small package of its own ---------------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_reader_counts_function_level_imports_and_skips_type_checking(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg import c\n"
                "def f():\n    from pkg.b import thing\n"
            ),
            "b.py": "from . import c\nthing = 1\n",
            "c.py": "import os\n",
            "sub/__init__.py": "",
            "sub/d.py": "from ..a import f\nfrom .. import b\n",
        },
    )
    assert import_graph(pkg) == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": set(),
        "pkg.sub": set(),
        "pkg.sub.d": {"pkg.a", "pkg.b"},
    }


def test_a_cycle_and_a_climb_are_found(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/x.py": "def f():\n    from pkg.low.y import g\n",
            "low/y.py": "from pkg.low.x import f\ndef g():\n    from pkg.high import h\n",
            "high.py": "from pkg.low.y import g\ndef h(): ...\n",
        },
    )
    graph = import_graph(pkg)
    assert cycles(graph) == [["pkg.high", "pkg.low.x", "pkg.low.y"]]
    assert climbs(graph, {"pkg.high": 0, "pkg.low": 1}) == [
        "pkg.low.y -> pkg.high (level 1 imports level 0)"
    ]
