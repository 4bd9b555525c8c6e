"""`dora.__all__` is honest: every name resolves, and nothing public is missing from it."""

from __future__ import annotations

import subprocess
import sys

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
