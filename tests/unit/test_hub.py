"""`model.path` as a Hub id, offline: found in a Hugging Face cache laid out as the hub client
lays it out, refused naming `model.path` and the places looked at when it is nowhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from dora.errors import ConfigError
from dora.models.hub import is_hub_id, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache(home: Path, repo_id: str) -> Path:
    """A snapshot of `repo_id` in the cache under `home`, as `snapshot_download` leaves it."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: a download must not be tried
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hf"


def test_a_cached_hub_id_resolves_to_its_snapshot(hf_home: Path) -> None:
    snapshot = _cache(hf_home, "Qwen/Qwen2.5-0.5B-Instruct")
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == snapshot
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct", download=False) == snapshot


def test_an_uncached_hub_id_offline_names_model_path_and_the_cache(hf_home: Path) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_model_path("Qwen/Qwen3-8B")
    text = str(err.value)
    assert "model.path = 'Qwen/Qwen3-8B'" in text
    assert str(hf_home / "hub") in text and "HF_HUB_OFFLINE" in text


def test_an_uncached_hub_id_in_a_dry_run_is_downloaded_at_start(
    hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve_model_path("Qwen/Qwen3-8B", download=False) is None


def test_a_missing_folder_names_model_path(hf_home: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.path = './models/x': no such folder"):
        resolve_model_path("./models/x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"model\.path = 'empty'.*no config\.json"):
        resolve_model_path("empty")


def test_a_local_folder_wins_over_a_hub_id(hf_home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "org" / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert resolve_model_path("org/model") == Path("org/model")


def test_hub_ids() -> None:
    assert is_hub_id("Qwen/Qwen3-8B") and is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_hub_id("./a/b") and not is_hub_id("/abs/path") and not is_hub_id("a/b/c")
