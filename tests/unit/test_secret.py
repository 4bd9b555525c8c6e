"""The run's secret (`dora.secret`): owner-only from its creation, kept on resume, refused when
others could read it, and the token of a config that sets none."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dora.config import load_config
from dora.errors import ConfigError
from dora.secret import create_run_secret, read_run_secret, with_run_token


def test_run_secret_is_owner_only_kept_and_refused_when_exposed(tmp_path: Path) -> None:
    old = os.umask(0)  # even a permissive umask gives an owner-only file
    try:
        path = create_run_secret(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = read_run_secret(tmp_path)
    assert secret is not None and len(secret) == 64
    assert create_run_secret(tmp_path) == path and read_run_secret(tmp_path) == secret

    config = load_config(None, [])
    assert with_run_token(config, tmp_path).serve.token == secret
    own = load_config(None, ["serve.token=mine"])
    assert with_run_token(own, tmp_path).serve.token == "mine", "a configured token wins"
    assert with_run_token(config, tmp_path / "elsewhere").serve.token == ""

    path.chmod(0o644)
    with pytest.raises(ConfigError, match="not owner-only"):
        read_run_secret(tmp_path)
    with pytest.raises(ConfigError, match="chmod 600"):
        create_run_secret(tmp_path)
    path.chmod(0o600)
    path.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        read_run_secret(tmp_path)
