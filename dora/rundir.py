"""Where a run keeps its files, and who owns them.

Where: `log.run_dir`, or a fresh `runs/<log.name>-<stamp>` folder. `dora serve` and `dora learn`
resolve it alike; a resumed run must name its folder (there is no newest-folder guess that could
continue the wrong run).

Who: one run at a time. Each side of a run owns a lock file in the run directory, `serve.lock`
(the journal, the rollout records, `summary.json`) and `learn.lock` (the checkpoints, the
trainer's records): `dora run` takes both, `dora serve` alone takes `serve.lock`, `dora learn`
alone takes `learn.lock` (rank 0 under a launcher that is not `dora learn` itself). A `dora serve`
and a `dora learn` started by hand on one run directory are one run, so they do not refuse each
other; a second serve or a second trainer is refused, and so is a `dora run` beside either.

The lock is the kernel's (`flock`): it is dropped when the last process holding the open file
goes, however it went (a crash, SIGKILL), so there is no stale lock to detect or clean up. The file
holds the owner's pid, command and start time for the refusal's message only; it is never read to
decide. `dora run` hands its open lock files to the sides it starts (`pass_fds`, with `LOCKED_ENV`
naming the directory, so they do not try to take it again): the directory stays owned while any
process of the run lives, also when `dora run` itself was killed and a side goes on. A side that
starts processes of its own (engines, ranks) does not hand the lock on: they die with it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dora.config import DoraConfig
from dora.errors import ConfigError, RunDirError

__all__ = ["LOCKED_ENV", "RunDirOwner", "own_run_dir", "resolve_run_dir"]

LOCKED_ENV = "DORA_RUN_DIR_LOCKED"
"""Set by the process that owns a run directory for the processes it starts: the directory."""


def resolve_run_dir(config: DoraConfig, *, resume: bool) -> Path:
    if config.log.run_dir:
        return Path(config.log.run_dir).resolve()
    if resume:
        raise ConfigError(
            "--resume needs log.run_dir: the run directory to continue (add "
            "log.run_dir=runs/<name>-<stamp>, the directory the run printed at its start)"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs", f"{config.log.name}-{stamp}").resolve()


@dataclass
class RunDirOwner:
    """The locks this process holds on a run directory (none when its parent holds them)."""

    run_dir: Path
    fds: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    """What a process this one starts needs in its environment to share the lock (with `fds`)."""


@contextlib.contextmanager
def own_run_dir(run_dir: Path, sides: Sequence[str], *, command: str) -> Iterator[RunDirOwner]:
    """Own `sides` ('serve', 'learn') of `run_dir` for the block, or raise `RunDirError` naming
    the process that owns it. Nothing is written to the directory when refused but the empty
    lock files (and the directory) if they did not exist."""
    run_dir = run_dir.resolve()
    if os.environ.get(LOCKED_ENV) == str(run_dir):  # the parent that started us owns it
        yield RunDirOwner(run_dir)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fds: list[int] = []
    try:
        for side in sides:
            fds.append(_lock(run_dir / f"{side}.lock", command=command))
        yield RunDirOwner(run_dir, fds=tuple(fds), env={LOCKED_ENV: str(run_dir)})
    finally:
        for fd in fds:
            os.close(fd)  # never LOCK_UN: children may share the lock and must keep it


def _lock(path: Path, *, command: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise
        raise RunDirError(_refusal(path)) from None
    owner = {"pid": os.getpid(), "command": command, "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
    return fd


def _refusal(path: Path) -> str:
    try:
        owner = json.loads(path.read_text())
        pid, command, since = int(owner["pid"]), str(owner["command"]), str(owner["since"])
    except (OSError, ValueError, KeyError, TypeError):  # taken a moment ago, not yet written
        pid, command, since = 0, "another dora process", "just now"
    who = f"pid {pid} ({command}, since {since})" if pid else command
    alive = pid > 0 and _alive(pid)
    if pid and not alive:
        who += " has exited, but a process it started still holds it"
    return (
        f"{path.parent} is in use by another run: {who} ({path.name}). Two runs in one "
        "directory would mix their journals, checkpoints and summaries: wait for that run to "
        f"end{f' or stop it (kill {pid})' if pid and alive else ''}, or set log.run_dir to "
        "another directory"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
