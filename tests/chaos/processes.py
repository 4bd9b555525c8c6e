"""What a test started: its children (`children`), and for the chaos tests' `owned` fixture
(conftest.py) what to stop at teardown."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux's /proc), for a test to find what a command started."""
    out: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(p) for p in path.read_text().split()]
        except FileNotFoundError:
            continue
    return out


@dataclass
class Owned:
    """What a test started: `procs` are killed and reaped at teardown if still running, and
    `groups` (the pids of children that lead sessions of their own) are SIGKILLed as groups."""

    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
