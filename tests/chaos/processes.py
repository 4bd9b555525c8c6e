"""What a chaos test started, for the `owned` fixture (conftest.py) to stop at teardown."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field


@dataclass
class Owned:
    """What a test started: `procs` are killed and reaped at teardown if still running, and
    `groups` (the pids of children that lead sessions of their own) are SIGKILLed as groups."""

    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
