"""The transfer queue's book of groups: every group it holds, its state and version, the
groups of each step until that step is durable, and the counts per version and state. The
staleness rules live in `transfer_queue.py`, on top of this class.

Costs do not grow with the length of a run or the size of a step: the counts keep no all-zero
version, and a durable step leaves the counts at once (O(K): its per-version counts) while its
groups leave `_groups` two per later admission (`_purge`), reading as gone meanwhile
(`_released`).
"""

from __future__ import annotations

from collections import deque

from dora.core.outcomes import GroupState, VersionCounts
from dora.errors import SchedulingError

__all__ = ["GroupBook"]

_STATES = tuple(GroupState)
_STATE_INDEX = {s: i for i, s in enumerate(_STATES)}


class _Group:
    __slots__ = (
        "attempts",
        "deadline",
        "gid",
        "masked",
        "pinned",
        "si",
        "state",
        "step",
        "version",
    )

    def __init__(self, gid: str, version: int, deadline: int) -> None:
        self.gid = gid
        self.version = version
        self.deadline = deadline
        self.state = GroupState.ADMITTED
        self.si = 0  # index of `state` in _STATES: per-version counts without hashing enums
        self.step = -1
        self.attempts = 0
        self.pinned = False
        self.masked = False


class GroupBook:
    """The groups a transfer queue holds (see the module docstring)."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}
        self._durable = -1  # the last durable step
        self._by_step: dict[int, list[str]] = {}  # assigned, not yet durable
        self._step_versions: dict[int, dict[int, int]] = {}  # step -> version -> groups
        self._unpurged: deque[list[str]] = deque()  # released ids still in `_groups`
        self._purge_at = 0  # position in `_unpurged[0]`
        self._per_version: dict[int, list[int]] = {}  # counts per state; no all-zero entry

    def state(self, group_id: str) -> GroupState | None:
        """The group's state, or None once it is durable, filtered or rolled back."""
        g = self._groups.get(group_id)
        return None if g is None or self._released(g) else g.state

    def group_states(self) -> dict[str, GroupState]:
        """Every group the queue holds, with its state (in admission order)."""
        return {gid: g.state for gid, g in self._groups.items() if not self._released(g)}

    def group_version(self, group_id: str) -> int:
        return self._get(group_id).version

    def deadline(self, group_id: str) -> int:
        return self._get(group_id).deadline

    def version_counts(self) -> dict[int, VersionCounts]:
        """Groups the queue holds, per version and state."""
        return {w: VersionCounts(*c) for w, c in sorted(self._per_version.items())}

    def _get(self, group_id: str) -> _Group:
        g = self._groups.get(group_id)
        if g is None or (g.state is GroupState.ASSIGNED and g.step <= self._durable):
            raise SchedulingError(f"unknown group {group_id!r}")  # gone, or released
        return g

    def _released(self, g: _Group) -> bool:
        """Assigned to a durable step: gone, though maybe not yet purged from `_groups`."""
        return g.step != -1 and g.step <= self._durable and g.state is GroupState.ASSIGNED

    def _purge(self, n: int | None) -> None:
        """Forget up to `n` released groups (None: all of them)."""
        todo = self._unpurged
        while todo and (n is None or n > 0):
            ids = todo[0]
            gid = ids[self._purge_at]
            g = self._groups.get(gid)
            if g is not None and self._released(g):  # not a later group of the same id
                del self._groups[gid]
            self._purge_at += 1
            if self._purge_at == len(ids):
                todo.popleft()
                self._purge_at = 0
            if n is not None:
                n -= 1

    def _count(self, g: _Group, delta: int) -> None:
        c = self._per_version.get(g.version)
        if c is None:
            c = self._per_version[g.version] = [0, 0, 0, 0]
        c[g.si] += delta
        if delta < 0 and not c[g.si] and not any(c):
            del self._per_version[g.version]

    def _add_count(self, version: int, si: int, delta: int) -> None:
        c = self._per_version.get(version)
        if c is None:
            c = self._per_version[version] = [0, 0, 0, 0]
        c[si] += delta
        if delta < 0 and not c[si] and not any(c):
            del self._per_version[version]

    def _move(self, g: _Group, state: GroupState) -> None:
        self._count(g, -1)
        g.state = state
        g.si = _STATE_INDEX[state]
        self._count(g, +1)

    def _record_assignment(self, g: _Group) -> None:
        self._by_step.setdefault(g.step, []).append(g.gid)
        versions = self._step_versions.setdefault(g.step, {})
        versions[g.version] = versions.get(g.version, 0) + 1

    def _release_through(self, step: int) -> list[str]:
        """The groups of the steps after the last durable one up to `step`: out of the counts
        now, out of `_groups` later."""
        released: list[str] = []
        for s in range(self._durable + 1, step + 1):
            ids = self._by_step.pop(s, None)
            if ids is None:
                continue
            for w, n in self._step_versions.pop(s).items():
                self._add_count(w, _STATE_INDEX[GroupState.ASSIGNED], -n)
            self._unpurged.append(ids)
            released += ids
        return released
