"""CPU priority by deadline: the instances whose calls the trainer needs first get the cores first.

On one CPU machine serve's engine processes and the trainer share every core, and when more
threads are runnable than there are cores the operating system shares the cores evenly. That is
the wrong share for a run under a staleness bound. A step closes only when its slowest group is
done, and nothing newer than `K` versions ahead may be admitted before it closes; the groups
with the earliest deadline are the oldest version's (the transfer queue assigns earliest
deadline first). So while the last long answer of the oldest version decodes on one instance,
instances of newer versions, whose groups would wait anyway, take most of the cores from it, and
then sit idle at the gate while it finishes.

Serve therefore keeps the model threads of an engine process it started under the normal policy
while the engine has a call of the oldest version in flight (or no call at all), and runs them
under `SCHED_IDLE` otherwise: they then run on the CPU that the oldest version's instances, the
trainer and serve itself leave over, which keeps every core busy without slowing the critical
path. An engine's main thread, its event loop, keeps the normal policy: it takes little CPU,
and answers health probes and streams results at once. The policies follow the
calls, checked every `EVERY_S`; a process's threads change only when its role changes. With one
version in flight (sync; the other modes between versions) every busy instance is of the oldest
version and nothing changes.

Lifting `SCHED_IDLE` again needs the right to raise a priority: root, `CAP_SYS_NICE`, or an
`RLIMIT_NICE` of 20 or more (`ulimit -e`). Serve probes it once; without it, off Linux, or for
instances that are not local processes (vLLM, attached, emulated), nothing changes, and serve
logs why (`serve.cpu_priority`).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterable, Mapping

__all__ = ["EVERY_S", "CpuPriority", "Instance", "foreground", "may_lift_idle", "set_policy"]

EVERY_S = 0.01
"""How often the policies follow the calls in flight (a decode step of the tiny model is ~1 ms,
a long answer hundreds)."""

_NORMAL = getattr(os, "SCHED_OTHER", 0)
_IDLE = getattr(os, "SCHED_IDLE", 5)


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


def may_lift_idle() -> bool:
    """Whether this process may move a thread from `SCHED_IDLE` back to the normal policy (tried
    on a thread of its own, which ends either way)."""
    if not hasattr(os, "sched_setscheduler") or not hasattr(os, "SCHED_IDLE"):
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, _IDLE, os.sched_param(0))
            os.sched_setscheduler(0, _NORMAL, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="dora-sched-probe")
    thread.start()
    thread.join()
    return bool(result and result[0])


def set_policy(pid: int, policy: int) -> bool:
    """Every thread of process `pid` but its main thread under `policy`; False when the process
    is gone. The engine's main thread runs its event loop (HTTP, health probes), which takes
    little CPU and must answer at once; the model runs on the others."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in threads:
        if int(tid) == pid:
            continue
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
    return True


Instance = tuple[str, int | None, Mapping[int, int]]
"""An instance as `CpuPriority` sees it: its id, its local process (None: not one), and its calls
in flight per version."""


class CpuPriority:
    """Applies `foreground` to the engine processes serve started (see the module docstring)."""

    def __init__(self) -> None:
        self._policy: dict[int, int] = {}
        self.switches = 0
        """Policy changes made (each moves every thread of one process)."""

    def apply(self, instances: Iterable[Instance]) -> None:
        """Set each local process's policy from the calls in flight now."""
        instances = list(instances)
        normal = foreground({name: versions for name, _, versions in instances})
        for name, pid, _ in instances:
            if pid is None:
                continue
            want = _NORMAL if name in normal else _IDLE
            if self._policy.get(pid, _NORMAL) != want and set_policy(pid, want):
                self._policy[pid] = want
                self.switches += 1

    async def run(self, instances: Callable[[], Iterable[Instance]]) -> None:
        """Follow the calls in flight until cancelled."""
        while True:
            self.apply(instances())
            await asyncio.sleep(EVERY_S)
