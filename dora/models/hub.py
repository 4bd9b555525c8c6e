"""`model.path` as a folder or as a Hugging Face Hub id, resolved before anything starts.

A path that exists is used as it is. Otherwise a name of the form `org/name` is a Hub id: it is
taken from the local Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`) when a snapshot is there, and
downloaded when the user's environment allows it (dora never sets `HF_HUB_OFFLINE` itself: an
offline node says so in its own environment). Anything else, or a Hub id that is neither cached
nor downloadable, is a `ConfigError` that names `model.path` and every place that was looked at.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dora.errors import ConfigError

__all__ = ["is_hub_id", "resolve_model_path"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str) -> bool:
    """Whether `path`, which is not a folder here, reads as a Hub id (`org/name`)."""
    return bool(_HUB_ID.match(path)) and not path.startswith(".") and ".." not in path


def hub_cache() -> Path:
    """The Hugging Face cache as the environment names it now (`HF_HUB_CACHE`, else
    `$HF_HOME/hub`, else `~/.cache/huggingface/hub`)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model_path(path: str, *, download: bool = True) -> Path | None:
    """The local folder of `model.path`. A Hub id comes from the cache, else from the Hub when
    `download` is true and the environment is not offline; with `download` false an uncached Hub
    id is None (it would be downloaded at start)."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(
                f"model.path = {path!r}: the folder {local.resolve()} has no config.json; a "
                "Hugging Face model folder holds config.json, the weights and the tokenizer"
            )
        return local
    if not is_hub_id(path):
        raise ConfigError(
            f"model.path = {path!r}: no such folder ({local.resolve()}), and it is not a "
            "Hugging Face Hub id (org/name)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = hub_cache()
    try:
        return Path(snapshot_download(path, local_files_only=True, cache_dir=cache))
    except LocalEntryNotFoundError:
        pass
    looked = f"no folder {local.resolve()}, and no snapshot of {path} in the cache {cache}"
    if not download:
        if _offline():
            raise ConfigError(f"model.path = {path!r}: {looked}, and HF_HUB_OFFLINE is set")
        return None
    if _offline():
        raise ConfigError(
            f"model.path = {path!r}: {looked}, and HF_HUB_OFFLINE is set: download it where the "
            "network is reachable (huggingface-cli download), or point model.path at a folder"
        )
    try:
        return Path(snapshot_download(path, cache_dir=cache))
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError(
            f"model.path = {path!r}: {looked}, and downloading it from the Hub failed ({exc})"
        ) from None
