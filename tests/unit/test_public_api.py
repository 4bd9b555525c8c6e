"""`dora.__all__` is honest: every name resolves, and nothing public is missing from it."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import dora


def test_every_exported_name_resolves() -> None:
    for name in dora.__all__:
        assert getattr(dora, name) is not None, name


def test_unknown_names_raise_attribute_error() -> None:
    try:
        dora.no_such_thing  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_dora_is_light() -> None:
    code = "import sys, dora; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_envs_import_only_names_of_the_public_api() -> None:
    """Every `from dora... import name` in envs/ names something in `dora.__all__`, the same object
    (the import-linter contract keeps envs off the internal modules; this keeps `__all__` complete
    for what they use)."""
    root = Path(__file__).resolve().parents[2] / "envs"
    missing: list[str] = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("dora"):
                continue
            module = importlib.import_module(node.module or "dora")
            for alias in node.names:
                public = alias.name in dora.__all__
                if not public or getattr(dora, alias.name) is not getattr(module, alias.name):
                    missing.append(f"{path.relative_to(root.parent)}: {node.module}.{alias.name}")
    assert not missing, f"envs import names that dora.__all__ lacks: {missing}"
