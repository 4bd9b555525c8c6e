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
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "settle_heap"]

YOUNG_THRESHOLD = 50_000
"""Net allocations of tracked objects between two young collections (CPython's default: 700)."""


def settle_heap() -> None:
    """Freeze the objects that exist now and make collections rarer (see the module docstring)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
