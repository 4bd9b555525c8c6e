"""Rollout metrics: a JSONL file in the run directory, and a live display in the terminal.

Records (one JSON object per line, `kind` first):
- `tick`, every `log.metrics_every_s`: per instance its version, leases and capacity, calls in
  flight and utilisation (the fraction of the last interval with at least one call running);
  live episodes per version, calls in flight per version, the transfer queue's groups per version
  and state, the staleness histogram, admitted/completed/assigned counts, migrations, weight loads,
  admission waits by reason (seconds), and event-loop lag (how late the tick woke, in ms);
- `step`, when a step's last group is sent: its groups' versions and staleness, and how long the
  step took to fill; the trainer's metrics are added by a `trained` record at `StepDone`;
- `weight_load`, per load: instance, version, seconds;
- `summary`, once at the end (also written as `summary.json`).

The ticker is the only periodic timer in `dora serve`; it measures, it never decides anything.
Writing a line is a small buffered write on the loop (flushed per record, so a crash loses at most
one); the display redraws from the same snapshot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import msgspec

__all__ = ["MetricsLog", "Progress", "Ticker"]

Record = dict[str, object]


class MetricsLog:
    """Appends records to `<run_dir>/rollout.jsonl`."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "rollout.jsonl"
        self._file: IO[bytes] | None = self.path.open("ab")
        self._encoder = msgspec.json.Encoder()
        self.start = time.monotonic()

    def write(self, kind: str, record: Record) -> None:
        if self._file is None:
            return
        line = {"kind": kind, "time_s": round(time.monotonic() - self.start, 4), **record}
        self._file.write(self._encoder.encode(line) + b"\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Progress:
    """A live `rich` display: steps filled and trained, and one row per instance."""

    def __init__(self, *, total_steps: int) -> None:
        from rich.console import Console
        from rich.live import Live

        self.total_steps = total_steps
        self._console = Console(stderr=True)
        self._live = Live(console=self._console, refresh_per_second=4, transient=False)
        self._live.start()

    def update(self, snap: Record) -> None:
        from rich.table import Table

        serving = snap["serving_versions"]
        assert isinstance(serving, dict)
        calls = ", ".join(f"v{w}: {n}" for w, n in sorted(serving.items())) or "none"
        table = Table(
            title=(
                f"dora serve  step {snap['step']}/{self.total_steps}  trained {snap['trained']}  "
                f"newest v{snap['newest']}\ncalls in flight per version: {calls}"
            ),
            expand=False,
        )
        for col in ("instance", "version", "leases", "in flight", "util"):
            table.add_column(col, justify="right")
        instances = snap["instances"]
        assert isinstance(instances, list)
        for inst in instances:
            state = "" if inst["ready"] else " (loading)"
            state = " (draining)" if inst["draining"] else state
            table.add_row(
                str(inst["id"]),
                f"{inst['version']}{state}",
                f"{inst['leases']}/{inst['capacity']}",
                str(inst["inflight"]),
                f"{100 * float(inst['util']):.0f}%",
            )
        self._live.update(table)

    def close(self) -> None:
        self._live.stop()


class Ticker:
    """Every `every_s`: take a snapshot, log it, show it, and measure event-loop lag."""

    def __init__(
        self,
        log: MetricsLog,
        snapshot: Callable[[float], Record],
        *,
        every_s: float,
        progress: Progress | None = None,
    ) -> None:
        self._log = log
        self._snapshot = snapshot
        self._every_s = every_s
        self._progress = progress
        self.max_lag_ms = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self._every_s
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            lag_ms = max(0.0, (loop.time() - due) * 1000.0)
            self.max_lag_ms = max(self.max_lag_ms, lag_ms)
            self.emit(lag_ms)
            due += self._every_s
            if due < loop.time():  # fell behind (a stalled loop): skip, do not burst
                due = loop.time() + self._every_s

    def emit(self, lag_ms: float) -> Record:
        snap = self._snapshot(lag_ms)
        self._log.write("tick", snap)
        if self._progress is not None:
            self._progress.update(snap)
        return snap
