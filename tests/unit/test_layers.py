"""The instance interface and the backends' clients load without torch or the embedded engine.

Serve drives the vLLM backend through `dora.instance`; if that pulled in `dora.engine.server`
(torch, transformers), every `dora serve` with vLLM would pay for a model stack it never uses.
Each import runs in a fresh interpreter, since this one has loaded torch long ago.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "dora.engine.server")


@pytest.mark.parametrize(
    "module",
    ["dora.instance", "dora.engine", "dora.engine.api", "dora.vllm.client", "dora.tool_calls"],
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
