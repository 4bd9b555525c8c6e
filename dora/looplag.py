"""How long an event loop keeps its wake-ups waiting, measured from inside the loop.

`LoopProbe` sleeps a fixed interval at a time and records how late each wake-up came: the time a
ready callback waited while something else held the loop (a long callback, a collection of the
garbage collector, a blocking call). `dora serve` reports the worst wait between two metrics ticks;
the emulated cluster keeps every sample for its median and p99.

Lateness says that the loop was held, not by what. `StallWatch` says by what: a thread that sees
the probe's heartbeat go quiet for `after_s` looks at the loop's thread from outside (the task the
loop is running, and the innermost frame of that thread's stack) and logs them, once per stall. An
`async def` environment hook that calls `time.sleep` is then named in the log, with its file and
line, while it still holds the loop.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["LoopProbe", "StallWatch", "p99"]

log = logging.getLogger("dora.serve")


class LoopProbe:
    """Run `run()` as a task on the loop to measure; `worst_ms` and `samples` fill as it goes."""

    def __init__(
        self, every_s: float, *, keep_samples: bool = False, watch: StallWatch | None = None
    ) -> None:
        self.every_s = every_s
        self.keep_samples = keep_samples
        self.watch = watch
        self.samples: list[float] = []
        """Every wake-up's lateness in ms, when `keep_samples`."""
        self.worst_ms = 0.0
        """The latest wake-up since the last `take_worst()`, in ms."""

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        if self.watch is not None:
            self.watch.start(loop)
        try:
            await self._run(loop)
        finally:
            if self.watch is not None:
                self.watch.stop()

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            if self.watch is not None:
                self.watch.beat()
            due = loop.time() + self.every_s
            await asyncio.sleep(self.every_s)
            late_ms = max(0.0, loop.time() - due) * 1000.0
            self.worst_ms = max(self.worst_ms, late_ms)
            if self.keep_samples:
                self.samples.append(late_ms)

    def take_worst(self) -> float:
        """The worst lateness since the previous call (ms), and start over."""
        worst, self.worst_ms = self.worst_ms, 0.0
        return worst


class StallWatch:
    """A thread that names what holds an event loop: when `beat()` (the probe's) has not come for
    `after_s`, it logs the loop's current task and the innermost frame of the loop's thread, once
    per stall; `stalls` keeps what it found, newest last (at most 100)."""

    def __init__(self, *, after_s: float = 1.0) -> None:
        self.after_s = after_s
        self.stalls: list[str] = []
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self._last = time.monotonic()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch `loop`, which runs on the calling thread."""
        self.beat()
        self._stop.clear()
        target = threading.get_ident()
        self._thread = threading.Thread(
            target=self._watch, args=(loop, target), name="dora-stall-watch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def _watch(self, loop: asyncio.AbstractEventLoop, thread_id: int) -> None:
        reported = 0.0
        while not self._stop.wait(self.after_s / 4):
            last = self._last
            held_s = time.monotonic() - last
            if held_s < self.after_s or reported == last:
                continue
            reported = last
            culprit = self._culprit(loop, thread_id)
            log.warning("the event loop has been held for %.1f s by %s", held_s, culprit)
            self.stalls = [*self.stalls[-99:], culprit]

    @staticmethod
    def _culprit(loop: asyncio.AbstractEventLoop, thread_id: int) -> str:
        """The loop's running task (by name and coroutine) and where its thread is now."""
        task = asyncio.current_task(loop)  # a dict read: safe from another thread
        what = "a callback outside any task"
        if task is not None:
            coro = task.get_coro()
            name = getattr(coro, "__qualname__", repr(coro))
            what = f"task {task.get_name()!r} ({name})"
        frame = sys._current_frames().get(thread_id)
        if frame is None:
            return what
        code = frame.f_code
        return f"{what}, at {code.co_filename}:{frame.f_lineno} in {code.co_name}"


def p99(ordered: Sequence[float]) -> float:
    """The 99th percentile of ascending `ordered` (its largest element below 100 items)."""
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
