"""No function in dora is longer than 80 lines.

A function that long does several things in a row; each is easier to read, name and test on its
own. The count runs from the first decorator (or the `def`) to the last line of the body, the
docstring, comments and blank lines included: what a reader has to scroll through. A nested
function counts on its own and within the function around it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dora

MAX_FUNCTION_LINES = 80


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """`path:line name -> lines` of every function under `root` longer than `limit`."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - start + 1
                if lines > limit:
                    where = f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"
                    found[where] = lines
    return found


def test_no_function_is_longer_than_80_lines() -> None:
    assert long_functions(Path(dora.__file__).parent) == {}


def test_the_count_takes_decorators_and_docstring(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(78))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        f'@staticmethod\ndef f():\n    """Doc."""\n{body}\n\nasync def g():\n{body}\n'
    )
    # f: its decorator, `def`, docstring and 78 lines; g: `def` and 78 lines
    assert long_functions(tmp_path / "pkg") == {"pkg/m.py:2 f": 81}
    assert long_functions(tmp_path / "pkg", limit=78) == {"pkg/m.py:2 f": 81, "pkg/m.py:83 g": 79}
