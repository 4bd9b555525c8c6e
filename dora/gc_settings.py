"""The garbage collector's settings for dora's long-running processes.

CPython's cyclic collector pauses the whole process, and a full (oldest-generation) collection
walks every tracked object. A process that has imported torch and transformers holds several
hundred thousand of them before it does any work, and an asynchronous rollout adds its own: a
coroutine, a context, futures and buffers per episode in flight, thousands of episodes at once.
Objects that live for seconds survive the young collections, so full collections come often, and
each one stopped `dora serve`'s event loop for 0.2-0.7 s at 128 instances and 8,192 episodes a
step (docs/emulation.md has the measurement); every episode, every timer and every HTTP response
waits for it.

`settle_heap()` runs once a process has started (imports done, model and data loaded):

- it collects once and freezes what is left (`gc.freeze`): the startup objects live as long as the
  process, so the collector stops walking them; reference counting still frees them;
- it makes the youngest generation larger (`YOUNG_THRESHOLD` allocations instead of 700), so that
  the short-lived objects of a request or an episode die before a collection sees them instead of
  being promoted, and full collections become rare. Cycles are still collected, only later.

An event loop that must answer within milliseconds (`dora serve`, the emulated cluster) goes
further with `collector_clock()`. The allocation count is a poor trigger there: it counts
allocations minus deallocations, so while old episodes end as fast as new ones start it barely
moves, and the young generation grows until one long collection (at 128 instances and 8,192
episodes a step: 40-300 ms young and 300-470 ms middle collections every few seconds, each
walking the coroutines, futures and HTTP objects of thousands of requests in flight). The clock
replaces it: automatic collection is off, the loop collects the youngest generation every
`YOUNG_EVERY_S` (the objects allocated since the last one: a few milliseconds of work) and
freezes what survived, so no later collection walks it again; every `FULL_EVERY_S` it unfreezes
everything and collects it all once, which frees the cycles that died meanwhile (one pause of
about 0.5 s for a process holding torch). Reference counting frees everything else at once, as
always.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import resource
from collections.abc import AsyncIterator

__all__ = ["FULL_EVERY_S", "YOUNG_EVERY_S", "YOUNG_THRESHOLD", "collector_clock", "settle_heap"]

YOUNG_THRESHOLD = 50_000
"""Net allocations of tracked objects between two young collections (CPython's default: 700)."""


def settle_heap() -> None:
    """Freeze the objects that exist now and make collections rarer (see the module docstring)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)


YOUNG_EVERY_S = 0.05
"""How often `collector_clock` collects the youngest generation."""
FULL_EVERY_S = 600.0
"""How often `collector_clock` collects everything, the frozen objects included."""


@contextlib.asynccontextmanager
async def collector_clock(
    *, young_every_s: float = YOUNG_EVERY_S, full_every_s: float = FULL_EVERY_S
) -> AsyncIterator[None]:
    """While the block runs, the running event loop collects on a clock instead of the
    allocation count (see the module docstring); automatic collection is back on after it."""
    task = asyncio.create_task(_collect(young_every_s, full_every_s), name="collector-clock")
    gc.disable()
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gc.enable()


async def _collect(young_every_s: float, full_every_s: float) -> None:
    loop = asyncio.get_running_loop()
    last_full = loop.time()
    while True:
        await asyncio.sleep(young_every_s)
        if loop.time() - last_full >= full_every_s:
            gc.unfreeze()
            gc.collect()
            last_full = loop.time()
        else:
            gc.collect(0)
        gc.freeze()


def peak_rss_mb() -> float:
    """The most resident memory this process has held so far, in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
