"""Where `dora learn` finds serve and its run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.config import load_config
from dora.errors import ConfigError
from dora.learn.main import ADDRESS_ENV, check_ranks_fit, resolve_run_dir, serve_address


def test_address_from_env_or_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    with pytest.raises(ConfigError, match=ADDRESS_ENV):
        serve_address(load_config(None, ["serve.port=0"]))
    assert serve_address(load_config(None, ["serve.port=5555"])) == "tcp://127.0.0.1:5555"
    monkeypatch.setenv(ADDRESS_ENV, "tcp://127.0.0.1:4444")
    assert serve_address(load_config(None, ["serve.port=5555"])) == "tcp://127.0.0.1:4444"


def test_resume_needs_a_run_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"log\.run_dir"):
        resolve_run_dir(load_config(None), resume=True)
    config = load_config(None, [f"log.run_dir={tmp_path}"])
    assert resolve_run_dir(config, resume=True) == tmp_path.resolve()
    assert resolve_run_dir(load_config(None), resume=False).name.startswith("dora-")


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts() -> None:
    two = load_config(None, ["learn.processes=2"])
    with pytest.raises(ConfigError, match=r"processes = 2 ranks, but this machine has 1 GPU"):
        check_ranks_fit(two, gpus=1)
    check_ranks_fit(two, gpus=0)  # CPU ranks over gloo
    check_ranks_fit(two, gpus=2)
    check_ranks_fit(load_config(None, ["learn.processes=2", "emulate.trainer=true"]), gpus=1)
