"""Rollout metrics: a JSONL file in the run directory, and a live display in the terminal.

Records (one JSON object per line, `kind` first; one struct per kind in `dora/records.py`):
- `tick`, every `log.metrics_every_s`: per instance its version, leases and capacity, calls in
  flight and utilisation (the fraction of the last interval with at least one call running);
  live episodes per version (in an LLM call, in the environment, parked), calls in flight per
  version, the transfer queue's groups per version
  and state, the staleness histogram, admitted/completed/assigned counts, migrations, weight loads,
  admission waits by reason (seconds), event-loop lag (how late the tick woke, in ms) and stall
  (the longest any wake-up waited since the previous tick, in ms);
- `step`, when a step's last group is sent: its groups' versions and staleness, and how long the
  step took to fill; the trainer's metrics are added by a `trained` record at `StepDone`;
- `eval`, per evaluation (`evaluate.py`): step, version, greedy accuracy, reward_mean, n, masked,
  seconds; ticks carry the last one as `eval` (version, accuracy), and the summary's `extra` the
  first and last accuracies (`eval_first_accuracy`, `eval_last_accuracy`, and their versions);
- `weight_load`, per load: instance, version, seconds; `drain`, `instance_failed`, `rollback`
  as they happen;
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
from typing import IO, TYPE_CHECKING

import msgspec

from dora.looplag import LoopProbe, StallWatch
from dora.records import Record, RolloutReport, Tick

if TYPE_CHECKING:
    from dora.protocol import Group
    from dora.serve.console import StepLines
    from dora.tracking import Tracking

__all__ = ["MetricsLog", "Progress", "RolloutReport", "SampleLog", "Ticker"]


class MetricsLog:
    """Appends records to `<run_dir>/rollout.jsonl`."""

    def __init__(
        self,
        run_dir: Path,
        *,
        tracking: Tracking | None = None,
        console: StepLines | None = None,
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "rollout.jsonl"
        self._file: IO[bytes] | None = self.path.open("ab")
        self._encoder = msgspec.json.Encoder()
        self.start = time.monotonic()
        self._tracking = tracking  # TensorBoard / W&B (dora/tracking.py): every record, if on
        self._console = console  # a line per `log.console_every` steps (dora/serve/console.py)

    def write(self, record: Record) -> None:
        if self._file is None:
            return
        fields = msgspec.to_builtins(record)
        fields.pop("time_s", None)  # the record's own is a placeholder: the log's clock sets it
        line = {"kind": fields.pop("kind"), "time_s": round(time.monotonic() - self.start, 4)}
        line.update(fields)
        self._file.write(self._encoder.encode(line) + b"\n")
        self._file.flush()
        if self._tracking is not None:
            self._tracking.record(line)
        if self._console is not None:
            self._console.observe(line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            if self._tracking is not None:
                self._tracking.close()


class Progress:
    """A live `rich` display: steps filled and trained, and one row per instance."""

    def __init__(self, *, total_steps: int) -> None:
        import logging

        from rich.console import Console
        from rich.live import Live
        from rich.logging import RichHandler

        self.total_steps = total_steps
        self._console = Console(stderr=True)
        self._live = Live(console=self._console, refresh_per_second=4, transient=False)
        # While the display owns the terminal, log records go through its console (printed above
        # the table) instead of straight to stderr, which would tear the display apart.
        self._root = logging.getLogger()
        self._saved = list(self._root.handlers)
        for handler in self._saved:
            self._root.removeHandler(handler)
        self._root.addHandler(RichHandler(console=self._console, show_path=False))
        self._live.start()

    def update(self, snap: Tick) -> None:
        from rich.table import Table

        serving = snap.serving_versions
        calls = ", ".join(f"v{w}: {n}" for w, n in sorted(serving.items())) or "none"
        if snap.eval is not None:
            calls += f"\nheld-out accuracy (greedy) v{snap.eval.version}: "
            calls += f"{100 * snap.eval.accuracy:.1f}%"
        table = Table(
            title=(
                f"dora serve  step {snap.step}/{self.total_steps}  trained {snap.trained}  "
                f"newest v{snap.newest}\ncalls in flight per version: {calls}"
            ),
            expand=False,
        )
        for col in ("instance", "version", "leases", "in flight", "util"):
            table.add_column(col, justify="right")
        for inst in snap.instances:
            state = "" if inst.ready else " (loading)"
            state = " (draining)" if inst.draining else state
            table.add_row(
                inst.id,
                f"{inst.version}{state}",
                f"{inst.leases}/{inst.capacity}",
                str(inst.inflight),
                f"{100 * inst.util:.0f}%",
            )
        self._live.update(table)

    def close(self) -> None:
        self._live.stop()
        for handler in list(self._root.handlers):
            self._root.removeHandler(handler)
        for handler in self._saved:
            self._root.addHandler(handler)


class Ticker:
    """Every `every_s`: take a snapshot, log it, show it, and measure event-loop lag.

    Two measures of the loop: `lag_ms`, how late the tick itself woke (one sample per tick), and
    `stall_ms`, the longest any wake-up waited since the previous tick, from a probe that sleeps
    `probe_s` at a time: a pause between two ticks shows in the second, where a one-second tick
    would see it only if it fell due during the pause. A stall of a second or more is also logged
    with the task that held the loop and where (`dora.looplag.StallWatch`)."""

    def __init__(
        self,
        log: MetricsLog,
        snapshot: Callable[[float, float], Tick],
        *,
        every_s: float,
        progress: Progress | None = None,
        probe_s: float = 0.01,
    ) -> None:
        self._log = log
        self._snapshot = snapshot
        self._every_s = every_s
        self._progress = progress
        self._probe = LoopProbe(probe_s, watch=StallWatch(after_s=1.0))
        self.max_lag_ms = 0.0
        self.max_stall_ms = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        probe = asyncio.ensure_future(self._probe.run())
        try:
            due = loop.time() + self._every_s
            while True:
                await asyncio.sleep(max(0.0, due - loop.time()))
                lag_ms = max(0.0, (loop.time() - due) * 1000.0)
                self.max_lag_ms = max(self.max_lag_ms, lag_ms)
                self.emit(lag_ms)
                due += self._every_s
                if due < loop.time():  # fell behind (a stalled loop): skip, do not burst
                    due = loop.time() + self._every_s
        finally:
            probe.cancel()

    def emit(self, lag_ms: float) -> Tick:
        """Log a snapshot now; its stall is the longest since the previous one."""
        stall_ms = max(self._probe.take_worst(), lag_ms)
        self.max_stall_ms = max(self.max_stall_ms, stall_ms)
        snap = self._snapshot(lag_ms, stall_ms)
        self._log.write(snap)
        if self._progress is not None:
            self._progress.update(snap)
        return snap


class SampleLog:
    """Writes one completed group in every `every` to `<run_dir>/samples.jsonl`
    (`log.samples_every`): the exact token ids each sample was trained on, with the text they
    decode to, so a user can see what the model is given (a missing `<bos>`, a wrong template)
    before trusting a run, and which version sampled which tokens (`version_spans`,
    `Sample.version_spans`)."""

    def __init__(self, run_dir: Path, *, every: int, decode: Callable[[list[int]], str]) -> None:
        self.path = run_dir / "samples.jsonl"
        self.every = every
        self._decode = decode
        self._seen = 0

    def write(self, group: Group) -> None:
        self._seen += 1
        if not self.every or (self._seen - 1) % self.every:
            return
        samples = []
        for s in group.samples:
            ids = s.tokens().tolist()
            samples.append(
                {
                    "token_ids": ids,
                    "prompt_len": s.prompt_len,
                    "loss_mask": s.mask().tolist(),
                    "version_spans": s.version_spans(),
                    "text": self._decode(ids),
                    "reward": s.reward,
                    "masked": s.masked,
                    "finish_reason": s.finish_reason,
                }
            )
        line = {"group": group.id, "prompt_id": group.prompt_id, "version": group.version}
        with self.path.open("ab") as f:
            f.write(msgspec.json.encode({**line, "samples": samples}) + b"\n")
