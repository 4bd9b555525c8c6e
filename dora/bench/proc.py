"""CPU seconds of process trees, and a run's trained steps, read from /proc and its records.

`dora bench modes` samples these while a run goes on: CPU-seconds are utime + stime of a process
and every live descendant plus the children they reaped (so an instance that exited still counts),
and trained steps are the `trained` lines of `rollout.jsonl` (whole lines only, read on from
where the last poll stopped).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from dora.records import Trained, decode_record

__all__ = ["POLL_S", "TICKS_PER_S", "TrainedCounter", "cpu_model", "own_cpu_s", "tree_cpu_s"]

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
POLL_S = 0.2
"""Seconds between two samples of a running benchmark's CPU and trained steps."""


def tree_cpu_s(roots: list[int]) -> float:
    """CPU seconds of `roots` and every live descendant, reaped children included."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        pid = int(entry)
        stats[pid] = fields
        children.setdefault(int(fields[1]), []).append(pid)
    total, todo = 0, list(roots)
    while todo:
        pid = todo.pop()
        if pid in stats:
            st = stats[pid]
            total += int(st[11]) + int(st[12]) + int(st[13]) + int(st[14])
        todo.extend(children.get(pid, []))
    return total / TICKS_PER_S


def own_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` alone (not its children): `dora serve` without its instances."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


class TrainedCounter:
    """Counts `trained` records in a growing rollout.jsonl (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.count, self._rest = path, 0, 0, b""

    def poll(self) -> int:
        if self.path.is_file():
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
            self.offset += len(data)
            *lines, self._rest = (self._rest + data).split(b"\n")
            self.count += sum(isinstance(decode_record(line), Trained) for line in lines)
        return self.count


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
