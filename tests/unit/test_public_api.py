"""`dora.__all__` is honest: every name resolves, nothing public is missing from it, and a type
checker sees each name as what it is (not as the `object` of the lazy `__getattr__`)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import mypy.api

import dora

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_lazy_names_the_type_checking_imports_and_all_agree() -> None:
    tree = ast.parse((ROOT / "dora" / "__init__.py").read_text())
    typed: dict[str, str] = {}
    literal: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module is not None
                typed.update({alias.name: imp.module for alias in imp.names})
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            literal = ast.literal_eval(node.value)
    assert typed == dora._EXPORTS
    assert literal == dora.__all__ == sorted(dora._EXPORTS)


def test_a_type_checker_sees_the_real_public_types(tmp_path: Path) -> None:
    """mypy on a user's module: `from dora import Env` is the class `dora.env.Env`, usable as an
    annotation, and every public name is exported (strict mode's `--no-implicit-reexport`).

    Only dora/__init__.py and the modules it exports from are analysed (`--follow-imports=skip`),
    so the test takes seconds, not the minutes of torch's stubs."""
    user = tmp_path / "user.py"
    user.write_text(
        "from dora import *\n"
        "from dora import Env, Task\n\n"
        "def prompt(env: Env, task: Task) -> None:\n"
        "    reveal_type(env)\n" + "".join(f"reveal_type({name})\n" for name in dora.__all__)
    )
    files: set[str] = {"dora/__init__.py"}
    for module in set(dora._EXPORTS.values()):
        path = ROOT / module.replace(".", "/")
        found = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
        files.update(str(f.relative_to(ROOT)) for f in found)
    (tmp_path / "mypy.ini").write_text("[mypy]\n")  # the user's settings, not dora's
    out, _, _ = mypy.api.run(
        [
            f"--config-file={tmp_path / 'mypy.ini'}",
            "--follow-imports=skip",
            "--no-implicit-reexport",
            f"--cache-dir={tmp_path / 'cache'}",
            *sorted(files),
            str(user),
        ]
    )
    revealed = [
        line.split("Revealed type is ")[1] for line in out.splitlines() if "Revealed" in line
    ]
    assert not [line for line in out.splitlines() if f"{user}:" in line and ": error:" in line], out
    assert revealed[0] == '"dora.env.Env"'
    assert len(revealed) == 1 + len(dora.__all__)
    assert not [r for r in revealed if "builtins.object" in r or r == '"Any"'], revealed


def test_every_name_the_environment_reference_documents_imports_from_dora() -> None:
    """docs/environments.md promises that the names of its `dora.*` sections import from `dora`."""
    import re

    text = (ROOT / "docs" / "environments.md").read_text()
    reference = text.split("## API reference", 1)[1]
    names: set[str] = set()
    for section in re.split(r"^### ", reference, flags=re.M)[1:]:
        if section.startswith("`dora."):
            # an entry opens a line: `Name` or `function(`
            names |= set(re.findall(r"^`([A-Z]\w*|\w+(?=\())", section, flags=re.M))
    hooks = {"setup", "tasks", "close", "demonstration", "step", "next", "reset", "reward"}
    missing = sorted(n for n in names - hooks if n not in dora.__all__)
    assert len(names) > 20, names
    assert not missing, f"documented but not importable from dora: {missing}"
