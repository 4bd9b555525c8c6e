"""CPU priority by deadline: the instances whose calls the trainer needs first get the cores first.

On one CPU machine serve's engine processes and the trainer share every core, and when more
threads are runnable than there are cores the operating system shares the cores evenly. That is
the wrong share for a run under a staleness bound. A step closes only when its slowest group is
done, and nothing newer than `K` versions ahead may be admitted before it closes; the groups
with the earliest deadline are the oldest version's (the transfer queue assigns earliest
deadline first). So while the last long answer of the oldest version decodes on one instance,
instances of newer versions, whose groups would wait anyway, take most of the cores from it, and
then sit idle at the gate while it finishes.

Serve therefore has an engine process it started step its model on its normal thread while the
engine has a call of the oldest version in flight (or no call at all), and on its `SCHED_IDLE`
thread otherwise (`POST /control/priority`, dora/engine/worker.py): the model then runs on the
CPU that the oldest version's instances, the trainer and serve itself leave over, which keeps
every core busy without slowing the critical path. The engine's event loop (HTTP, health probes,
streaming) stays on its main thread under the normal policy. The roles follow the calls, checked
every `EVERY_S`; an engine hears of its role only when it changes. With one version in flight
(sync; the other modes between versions) every busy instance is of the oldest version and
nothing changes.

The engine hands its model between two threads rather than changing one thread's policy, so no
privilege is needed (lowering a thread to `SCHED_IDLE` is open to every process, lifting it
back is not). Instances that are not engine processes serve started (vLLM, attached, emulated)
are left alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping

from dora.instance import SetBackground

__all__ = ["CALL_TIMEOUT_S", "EVERY_S", "CpuPriority", "Instance", "foreground"]

log = logging.getLogger(__name__)

EVERY_S = 0.01
"""How often the roles follow the calls in flight (a decode step of the tiny model is ~1 ms, a
long answer hundreds)."""

CALL_TIMEOUT_S = 1.0
"""How long an engine may take to answer a role change (a loopback call of a few ms): a hung
instance then delays the others' changes by this much at most until serve declares it dead."""


def foreground(inflight_versions: Mapping[str, Mapping[int, int]]) -> set[str]:
    """The instances that keep the normal policy: those with a call of the oldest version in
    flight, and those with no call in flight. `inflight_versions`: per instance, the calls in
    flight per version (no zero entries)."""
    busy = [v for versions in inflight_versions.values() for v in versions]
    oldest = min(busy, default=None)
    return {
        instance
        for instance, versions in inflight_versions.items()
        if not versions or oldest in versions
    }


Instance = tuple[str, SetBackground | None, Mapping[int, int]]
"""An instance as `CpuPriority` sees it: its id, how to set its role (None: not an engine process
serve started), and its calls in flight per version."""


class CpuPriority:
    """Applies `foreground` to the engine processes serve started (see the module docstring)."""

    def __init__(self) -> None:
        self._background: dict[SetBackground, bool] = {}
        """Each engine's role as last set, by its setter (a restarted instance brings a new one)."""
        self.switches = 0
        """Role changes made."""

    async def apply(self, instances: Iterable[Instance]) -> None:
        """Tell each engine whose role the calls in flight now change it."""
        instances = list(instances)
        normal = foreground({name: versions for name, _, versions in instances})
        changes = [
            (name, set_background, name not in normal)
            for name, set_background, _ in instances
            if set_background is not None
            and self._background.get(set_background, False) != (name not in normal)
        ]
        if not changes:
            return
        results = await asyncio.gather(
            *(
                asyncio.wait_for(set_background(background), CALL_TIMEOUT_S)
                for _, set_background, background in changes
            ),
            return_exceptions=True,
        )
        for (name, set_background, background), result in zip(changes, results, strict=True):
            if isinstance(result, BaseException):
                # a dead instance leaves the router; a live one is asked again next time
                log.debug("cpu priority: instance %s did not take its role: %r", name, result)
                continue
            self._background[set_background] = background
            self.switches += 1

    async def run(self, instances: Callable[[], Iterable[Instance]]) -> None:
        """Follow the calls in flight until cancelled."""
        while True:
            await self.apply(instances())
            await asyncio.sleep(EVERY_S)
