"""The groups whose episodes run now in this serve: one record, with the leases they hold.

The dispatcher starts a group's task here and the task leaves it when it ends; a trainer's
roll-back stops the running groups it removes (`stop`). A group's `G` episodes hold the leases
`group_leases(gid, G)`, named here once for all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

__all__ = ["RunningGroups", "group_leases", "lease_group"]


def group_leases(gid: str, size: int) -> list[str]:
    """The lease ids of a group's `size` episodes."""
    return [f"{gid}/{i}" for i in range(size)]


def lease_group(lease_id: str) -> str:
    """The group a lease belongs to (the part before the last `/`)."""
    return lease_id.rpartition("/")[0]


class RunningGroups:
    """The running groups' tasks (see the module docstring). `close_lease` ends a lease on the
    router alone (a roll-back's orchestrator forgets it on its own)."""

    def __init__(self, *, group_size: int, close_lease: Callable[[str], object]) -> None:
        self._size = group_size
        self._close_lease = close_lease
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def __contains__(self, gid: object) -> bool:
        return gid in self._tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def started(self, gid: str, task: asyncio.Task[None]) -> None:
        self._tasks[gid] = task

    def ended(self, gid: str) -> None:
        """The group's task ends (completed, failed or stopped)."""
        self._tasks.pop(gid, None)

    def stop(self, gids: Iterable[str]) -> None:
        """Stop those of `gids` that run: their leases end first (so their episodes' ends tell
        the orchestrator nothing), then their tasks are cancelled."""
        for gid in gids:
            task = self._tasks.pop(gid, None)
            if task is not None:
                for lid in group_leases(gid, self._size):
                    self._close_lease(lid)
                task.cancel()
