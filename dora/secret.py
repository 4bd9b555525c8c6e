"""The run's secret: the token of a run whose config sets no `serve.token`.

`dora run` creates `{run_dir}/secret` once (64 hex digits from `secrets`) and reuses it when the
run resumes. The file is created owner-only (mode 0600 from its first byte: no other user can read
it, even for a moment) and is refused when it is not: readable by others, or owned by another user
(a planted secret would let its author in). `dora serve` and `dora learn` read it from the run
directory (`with_run_token`), so a run's sides started on their own on one run directory use it
too; a `serve.token` the config sets wins (sides on two machines share that one).

The token is then `serve.token` for everything that takes one: the trainer link's `Hello`, the
bearer token of the control routes of the engines serve starts (`DORA_ENGINE_TOKEN`), vLLM's API
key (`VLLM_API_KEY`). It never goes on a command line (any local user can read those), into the
run's `config.toml`, or into a log.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

import msgspec

from dora.config import DoraConfig
from dora.errors import ConfigError

__all__ = ["SECRET_FILE", "create_run_secret", "read_run_secret", "with_run_token"]

SECRET_FILE = "secret"


def create_run_secret(run_dir: Path) -> Path:
    """`{run_dir}/secret`, created owner-only if absent; an existing one is checked and kept."""
    path = run_dir / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        read_run_secret(run_dir)  # a resumed run keeps its secret, if it is still private
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def read_run_secret(run_dir: Path) -> str | None:
    """The run's secret, or None if the run directory holds none."""
    path = run_dir / SECRET_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the run's secret {path}: {exc}") from None
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        if info.st_uid != os.geteuid():
            raise ConfigError(
                f"the run's secret {path} belongs to user {info.st_uid}, not to this user: "
                "delete it (dora run makes a new one) or set serve.token"
            )
        if info.st_mode & 0o077 or not stat.S_ISREG(info.st_mode):
            raise ConfigError(
                f"the run's secret {path} is not owner-only (mode {stat.filemode(info.st_mode)}): "
                f"other users could read it; run `chmod 600 {path}`"
            )
        token = f.read().strip()
    if not token:
        raise ConfigError(f"the run's secret {path} is empty: delete it (dora run makes a new one)")
    return token


def with_run_token(config: DoraConfig, run_dir: Path) -> DoraConfig:
    """`config` with the run's secret as `serve.token`, unless the config sets one or the run
    directory holds no secret."""
    if config.serve.token:
        return config
    token = read_run_secret(run_dir)
    if token is None:
        return config
    return msgspec.structs.replace(config, serve=msgspec.structs.replace(config.serve, token=token))
