"""A child process that dies with its parent: Linux's parent-death signal (`PR_SET_PDEATHSIG`).

`dora serve` starts its engines and `dora learn` its ranks as children that hold cores, memory
and GPUs; killed without a chance to stop them (SIGKILL, the OOM killer), the parent would leave
them running as orphans. Each child asks the kernel for a signal when its parent goes.

The signal comes when the *thread* that forked the child exits, not the whole parent process. The
parents that use this fork from their main thread, which lives as long as they do: serve starts
every engine (and every replacement) from its event loop, which `asyncio.run` runs in the main
thread; `dora learn` runs torchrun from its main thread. A parent that started children from a
short-lived worker thread would see them die with that thread.

A child that asks only after its parent died (the window between fork and the request) would
never get the signal, so the parent passes its pid (`PARENT_ENV`) and the child checks it once the
request is made.

A child that `dora run` supervises also tells it when it started (`mark_ready`): failures from then
on are faults worth a restart, failures before it are not (dora/launch.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

__all__ = ["PARENT_ENV", "READY_ENV", "die_with_parent", "die_with_parent_from_env", "mark_ready"]

PARENT_ENV = "DORA_PARENT_PID"
"""The pid of the process a child must die with, set by the parent in the child's environment."""

READY_ENV = "DORA_READY_FILE"
"""The file a supervised child creates once it started, named by `dora run` in its environment."""

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, *, parent_pid: int | None = None) -> None:
    """Ask Linux to send `sig` to this process when its parent exits (a no-op elsewhere); with
    `parent_pid`, send it now if that parent is already gone."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def die_with_parent_from_env(sig: int = signal.SIGKILL) -> None:
    """`die_with_parent` for a child whose parent named itself in `PARENT_ENV` (else nothing)."""
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit():
        die_with_parent(sig, parent_pid=int(parent))


def mark_ready() -> None:
    """Tell `dora run` that this side started: it restarts it from now on if it fails. Nothing when
    the side runs alone."""
    path = os.environ.get(READY_ENV)
    if path:
        Path(path).touch()
