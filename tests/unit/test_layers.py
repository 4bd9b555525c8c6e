"""Layers: the instance interface and the backends' clients load without torch or the engine, and
the import-linter contracts in pyproject.toml (the `layers` contract among them) name every module
they must.

Serve drives the vLLM backend through `dora.instance`; if that pulled in `dora.engine.server`
(torch, transformers), every `dora serve` with vLLM would pay for a model stack it never uses.
Each import runs in a fresh interpreter, since this one has loaded torch long ago.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import dora

HEAVY = ("torch", "transformers", "dora.engine.server")


@pytest.mark.parametrize(
    "module",
    ["dora.instance", "dora.engine", "dora.instance.api", "dora.vllm.client", "dora.tool_calls"],
)
def test_module_imports_without_torch(module: str) -> None:
    code = f"import sys, {module}; print(*[m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [], f"importing {module} loaded {out.stdout.split()}"


def test_engine_names_still_resolve_lazily() -> None:
    import dora.engine
    from dora.instance import EngineClient

    assert dora.engine.EngineClient is EngineClient
    assert dora.engine.EngineServer.__module__ == "dora.engine.server"
    with pytest.raises(AttributeError, match="no_such_thing"):
        dora.engine.no_such_thing  # type: ignore[attr-defined]  # noqa: B018


def _contracts() -> dict[str, dict[str, object]]:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    return {c["name"]: c for c in config["contracts"]}


def _top_level() -> set[str]:
    return {f"dora.{m.name}" for m in pkgutil.iter_modules(dora.__path__)}


def test_the_core_contract_names_every_other_module() -> None:
    """A new top-level module is forbidden to dora/core until someone decides otherwise."""
    (core,) = [c for c in _contracts().values() if c.get("source_modules") == ["dora.core"]]
    forbidden = set(core["forbidden_modules"])  # type: ignore[call-overload]
    assert forbidden == (_top_level() - {"dora.core", "dora.errors"}) | {"envs"}


def test_the_envs_contract_forbids_every_module_of_dora() -> None:
    """envs import `dora` itself (the names of `dora.__all__`), never one of its modules."""
    (envs,) = [c for c in _contracts().values() if c.get("source_modules") == ["envs"]]
    assert set(envs["forbidden_modules"]) == _top_level()  # type: ignore[call-overload]


def test_the_levels_name_every_top_level_module_once() -> None:
    """The `layers` contract states where every module of dora sits; one it does not name could
    import anything."""
    (layers,) = [c for c in _contracts().values() if c["type"] == "layers"]
    named = [
        name.strip()
        for layer in layers["layers"]  # type: ignore[attr-defined]
        for name in layer.replace(":", "|").split("|")
    ]
    assert sorted(named) == sorted(_top_level())


MAX_MODULE_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    """A module past 600 lines holds more than one responsibility; split it by what it does."""
    root = Path(dora.__file__).parent
    sizes = {
        p.relative_to(root.parent): len(p.read_text().splitlines()) for p in root.rglob("*.py")
    }
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES} == {}
