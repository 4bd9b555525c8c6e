"""Benchmarks: each prints ratios or rates measured side by side in one run (`dora bench NAME`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def summary(doc: str | None) -> str:
    """A module docstring's first paragraph as one line: a benchmark's `--help` description."""
    return " ".join((doc or "").split("\n\n")[0].split())


def dora_run(config: str, overrides: list[str], run_dir: Path, log: Path) -> int:
    """`dora run CONFIG overrides` into `run_dir`, its output in `log`; its exit code."""
    cmd = [sys.executable, "-m", "dora.cli", "run", config, *overrides]
    cmd += [f"log.run_dir={run_dir}", "log.progress=false"]
    with log.open("wb") as f:
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
