"""What `dora run --resume` checks before it starts anything: the run directory holds a run to
continue, and the settings that define that run are the ones it was started with.

A resume continues one run: serve replays its journal into a transfer queue built from the
config (B, K, T, the retry and filling rules), the trainer loads a checkpoint trained under the
config's model, loss and optimizer, and the prompt stream continues at a journaled position of
the config's data. Changing any of those would mix two runs silently (groups of G = 8 and of
G = 4 in one run, a queue that replays to another state than the one that died), so every
setting defines the run except the ones listed in `SAFE_ON_RESUME`: how the run is served and
supervised (timeouts, instances, ports, logging, restarts), the trainer's speed and memory knobs,
and the held-out evaluation, none of which changes what is trained on or how. docs/config.md
lists them (generated from this tuple).

`learn.steps` defines the run too: the last steps' deadlines are cut at the horizon
(`min(w + K, T - 1)`), so the journal replays to another queue under another T.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec

from dora.config import DoraConfig, load_config
from dora.config_rules import SAFE_ON_RESUME, safe_on_resume
from dora.config_text import render_toml
from dora.errors import ConfigError, RunDirError

__all__ = [
    "SAFE_ON_RESUME",
    "check_fresh",
    "check_resumable",
    "check_resume",
    "keep_run_config",
    "safe_on_resume",
    "write_run_config",
]


JOURNAL = Path("journal", "queue.msgpack")
"""Serve's journal of the transfer queue, relative to the run directory (dora/serve/journal.py)."""


def check_resumable(run_dir: Path, *, config: bool = True) -> None:
    """Raise `RunDirError` unless `run_dir` holds a run that can be continued: its config (which
    `dora run` writes; `config=False` for `dora serve` alone) and serve's journal. The trainer
    checks its own checkpoint."""
    needs = [(JOURNAL, "serve's journal: what was sampled, sent and trained")]
    if config:
        needs.insert(0, (Path("config.toml"), "the run's settings"))
    for needed, what in needs:
        if not (run_dir / needed).is_file():
            raise RunDirError(
                f"--resume: {run_dir / needed} ({what}) is missing, so {run_dir} holds no run "
                "that can be continued: check log.run_dir, or start a new run without --resume"
            )


def check_fresh(run_dir: Path) -> None:
    """Raise `RunDirError` if a new run would start on top of another one's journal or
    checkpoints."""
    for held in (JOURNAL, Path("checkpoints", "latest")):
        if (run_dir / held).exists():
            raise RunDirError(
                f"{run_dir} already holds a run ({held} exists): pass --resume to continue it, "
                "or set log.run_dir to a new directory"
            )


def check_resume(run_dir: Path, config: DoraConfig) -> None:
    """Raise `RunDirError` naming every key (old -> new) where `config` would change the run
    saved in `run_dir/config.toml`."""
    path = run_dir / "config.toml"
    try:
        saved = load_config(path)
    except ConfigError as exc:
        raise RunDirError(f"--resume: the run's own settings do not load: {exc}") from None
    old, new = _flat(msgspec.to_builtins(saved)), _flat(msgspec.to_builtins(config))
    changes = [
        f"  {key}: {_show(old.get(key, _UNSET))} -> {_show(new.get(key, _UNSET))}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key, _UNSET) != new.get(key, _UNSET) and not safe_on_resume(key)
    ]
    if changes:
        raise RunDirError(
            f"--resume would change the run in {run_dir}: these settings define it (its journal "
            "replays under them, its checkpoints were trained with them) and must stay as they "
            "were:\n" + "\n".join(changes) + f"\nSet them back (the run's settings are in {path})"
            " or start a new run in another directory; what a resume may change is listed in "
            "docs/config.md"
        )


def write_run_config(run_dir: Path, config: DoraConfig, *, name: str = "config.toml") -> None:
    """Save the run's settings as `run_dir/config.toml` (or `name`), the record a resume is
    compared with (and the config serve's runners read): owner-only, and without `serve.token`
    (the run's secret stays in its own file)."""
    record = msgspec.structs.replace(config, serve=msgspec.structs.replace(config.serve, token=""))
    path = run_dir / name
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(render_toml(record))
    os.chmod(tmp, 0o600)  # an older temporary file keeps its mode through O_CREAT
    os.replace(tmp, path)


def keep_run_config(run_dir: Path, config: DoraConfig, *, resume: bool) -> None:
    """For `dora serve` and `dora learn` started on their own: a resume is compared with the
    run's saved settings (`check_resume`) when the run directory holds them; a fresh start saves
    them unless another side (or `dora run`) already did."""
    if (run_dir / "config.toml").is_file():
        if resume:
            check_resume(run_dir, config)
        return
    write_run_config(run_dir, config)


_UNSET = object()


def _flat(table: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: object) -> str:
    return "(unset)" if value is _UNSET else json.dumps(value)
