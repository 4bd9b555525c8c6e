"""How long an event loop keeps its wake-ups waiting, measured from inside the loop.

`LoopProbe` sleeps a fixed interval at a time and records how late each wake-up came: the time a
ready callback waited while something else held the loop (a long callback, a collection of the
garbage collector, a blocking call). `dora serve` reports the worst wait between two metrics ticks;
the emulated cluster keeps every sample for its median and p99.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

__all__ = ["LoopProbe", "p99"]


class LoopProbe:
    """Run `run()` as a task on the loop to measure; `worst_ms` and `samples` fill as it goes."""

    def __init__(self, every_s: float, *, keep_samples: bool = False) -> None:
        self.every_s = every_s
        self.keep_samples = keep_samples
        self.samples: list[float] = []
        """Every wake-up's lateness in ms, when `keep_samples`."""
        self.worst_ms = 0.0
        """The latest wake-up since the last `take_worst()`, in ms."""

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
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


def p99(ordered: Sequence[float]) -> float:
    """The 99th percentile of ascending `ordered` (its largest element below 100 items)."""
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
