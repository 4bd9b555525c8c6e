"""A config as written: the sections of a TOML or YAML file with `key=value` overrides applied,
before defaults, types and rules (`dora.config` does those). Callers that must tell a key the user
set from one left at its default read this."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path

from dora.errors import ConfigError

__all__ = ["raw_config", "read_config_file"]


def raw_config(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, object]:
    """The file's sections (none without a file) with the dotted overrides set into them."""
    raw: dict[str, object] = {}
    if path is not None:
        raw = read_config_file(Path(path))
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value, origin=item)
    return raw


def read_config_file(path: Path) -> dict[str, object]:
    """The sections of a TOML or YAML config file as written: no overrides, defaults or checks
    (what a caller needs to tell a key the file sets from one left at its default)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data: object = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"{path}: config files end in .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a table of sections")
    return data


def _parse_override(item: str) -> tuple[str, object]:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    try:
        value: object = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word is a string: rollout.mode=sync
    return key.strip(), value


def _set_dotted(raw: dict[str, object], key: str, value: object, *, origin: str) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {origin!r}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value
