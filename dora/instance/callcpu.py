"""Serve's CPU per model call, split into its parts, cheap enough to leave on.

Each part is a synchronous stretch of serve's work for one call, timed with `time.thread_time`
(CPU of serve's event-loop thread, so another thread's work is not counted): `request` (building
and encoding the generate body), `answer` (decoding the instance's answer into a `Completion`) and
`turn` (the episode's work between two calls: detokenizing the answer and rendering the next
message). A stretch holds no `await`, so no other task's
work falls inside it. The rest of serve's CPU per call (the event loop, the HTTP stack, admission
and completion) is the process's CPU divided by `calls`, less these parts: `dora bench cluster`
prints both. One process-wide clock, read into the run's summary (`call_cpu_s`, `model_calls`).
With episode runners (`serve.runners`) each runner's process reports its CPU to serve (the
`runner_cpu_s` of each tick), and the bench adds it to the total as `runners`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["CALL_CPU", "CallCpu"]

T = TypeVar("T")


class CallCpu:
    """Seconds of thread CPU by part, and the number of model calls they were spent on."""

    def __init__(self) -> None:
        self.calls = 0
        self.seconds: dict[str, float] = {}

    def add(self, part: str, started: float) -> None:
        """Count the thread CPU since `started` (a `time.thread_time()` reading) to `part`."""
        self.seconds[part] = self.seconds.get(part, 0.0) + time.thread_time() - started

    def timed(self, part: str, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` (synchronous), its thread CPU counted to `part`."""
        started = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.add(part, started)

    def per_call_us(self) -> dict[str, float]:
        """Microseconds of CPU per model call, by part (empty before the first call)."""
        if not self.calls:
            return {}
        return {k: v * 1e6 / self.calls for k, v in self.seconds.items()}


CALL_CPU = CallCpu()
"""The clock of this process: the instance clients and the episode runner add to it."""
