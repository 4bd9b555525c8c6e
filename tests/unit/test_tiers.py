"""The fast tier (`python -m pytest -m "not slow and not chaos"`, README.md) still covers every
part: each folder of tests keeps at least one test that is neither `slow` nor `chaos`, so marking
a part's last quick test `slow` fails here instead of leaving that part untested day to day."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LEFT_OUT = {"slow", "chaos"}


def _marks(node: ast.AST) -> set[str]:
    """The `pytest.mark.NAME` names used anywhere inside `node`."""
    return {
        sub.attr
        for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute)
        and isinstance(sub.value, ast.Attribute)
        and sub.value.attr == "mark"
    }


def fast_tests(path: Path) -> list[str]:
    """The test functions of `path` that the fast tier runs."""
    tree = ast.parse(path.read_text())
    module_marks = [
        _marks(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
    ]
    if any(marks & LEFT_OUT for marks in module_marks):
        return []
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
        and not any(_marks(d) & LEFT_OUT for d in node.decorator_list)
    ]


def test_fast_tests_reads_module_and_function_marks(tmp_path: Path) -> None:
    source = tmp_path / "test_x.py"
    source.write_text(
        "import pytest\n\n"
        "def test_quick(): ...\n\n"
        "@pytest.mark.slow\ndef test_long(): ...\n\n"
        "@pytest.mark.timeout(5)\nasync def test_async(): ...\n"
    )
    assert fast_tests(source) == ["test_quick", "test_async"]
    source.write_text("import pytest\n\npytestmark = [pytest.mark.chaos]\n\ndef test_a(): ...\n")
    assert fast_tests(source) == []


def test_every_folder_of_tests_has_a_test_in_the_fast_tier() -> None:
    folders = sorted({p.parent for p in TESTS.rglob("test_*.py")})
    assert TESTS / "integration" / "serve" in folders
    uncovered = [
        str(folder.relative_to(TESTS))
        for folder in folders
        if not any(fast_tests(path) for path in folder.glob("test_*.py"))
    ]
    assert not uncovered, f"no test of these folders runs in the fast tier: {uncovered}"
