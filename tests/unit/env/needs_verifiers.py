"""The skip of the verifiers tests where the extra is missing (CI installs it: never skipped)."""

from __future__ import annotations

import importlib.metadata

import pytest

from envs.verifiers.classic import supported


def skip_unless_verifiers(module: str) -> None:
    """Skip the calling test module unless verifiers `module`, at the extra's pinned versions,
    and the `openai` client are installed."""
    pytest.importorskip(module)
    pytest.importorskip("openai")
    if not supported(importlib.metadata.version("verifiers")):
        pytest.skip("envs.verifiers runs on verifiers>=0.3.1,<0.4", allow_module_level=True)
