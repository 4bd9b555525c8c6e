"""Placement: the orchestrator's plan and the router's leases, kept in step.

The dispatcher (groups) and the evaluator (held-out episodes) open and end leases through one
`Placement`: `place` asks the orchestrator for an instance of a version with room and opens the
leases there on the router; `end` closes a lease on the router and tells the orchestrator, whose
actions `apply` carries out at once (`Migrate`, `Park`, `Resume`, `Fail` are router bookkeeping
plus an interrupt RPC in a task; `Drain`/`Undrain` are logged; a `Load` goes to the instance
lifecycle, `on_load`, and an `Unload` too, `on_unload`). Every `apply` sets `changed` (the
dispatcher waits on it, never polls) and calls the listeners (the evaluator's `wake`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from dora.core.orchestrator import (
    Action,
    Fail,
    Load,
    Migrate,
    Mode,
    Orchestrator,
    Park,
    Resume,
    Unload,
)
from dora.core.orchestrator import (
    Drain as DrainAction,
)
from dora.core.orchestrator import (
    Undrain as UndrainAction,
)
from dora.errors import SchedulingError
from dora.records import Drain, RequestFailed, Undrain
from dora.serve.metrics import MetricsLog
from dora.serve.router import LeaseSampler, Router
from dora.serve.spawn import Spawner

__all__ = ["Placement"]


class Placement:
    """Leases on instances, for groups and evaluations alike (see the module docstring)."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        router: Router,
        *,
        metrics: MetricsLog,
        spawn: Spawner,
    ) -> None:
        self._orchestrator = orchestrator
        self._router = router
        self._metrics = metrics
        self._spawn = spawn
        self.changed = asyncio.Event()
        """Set by every state change that can unblock admission."""
        self.on_load: Callable[[Load], None] = _no_loads
        """Carries out a `Load` (the instance lifecycle sets it)."""
        self.on_unload: Callable[[Unload], None] = _no_loads
        """Carries out an `Unload` (the instance lifecycle sets it)."""
        self.listeners: list[Callable[[], None]] = []
        """Called after every `apply` (a slot may have freed, a version loaded)."""

    def can_place(self, n: int, *, version: int) -> str | None:
        """An accepting instance of `version` with room for `n` more leases, if any."""
        return self._orchestrator.can_place(n, version=version)

    def place(self, leases: Sequence[str], *, version: int, pinned: bool = False) -> str:
        """Open `leases` on one instance of `version` (the caller checked `can_place`); `pinned`:
        they need that version for every token, even in mode inflight (`Router.open`)."""
        where = self._orchestrator.place(leases, version=version)
        assert where is not None, "can_place said there was room"
        for lid in leases:
            self._router.open(lid, version=version, instance=where, pinned=pinned)
        return where

    def drop(self, lease_id: str) -> None:
        """Close a lease on the router alone: a roll-back's orchestrator forgets it itself."""
        self._router.close(lease_id)

    def leases_above(self, version: int) -> list[str]:
        """The leases that sample a version newer than `version` now."""
        return self._router.leases_above(version)

    def sampler(self, lease_id: str) -> LeaseSampler:
        return self._router.sampler(lease_id)

    def end(self, lease_id: str, *, forgotten_ok: bool = False) -> None:
        """The lease's episode ended (also on error or cancellation): its slot is free. With
        `forgotten_ok`, a lease the orchestrator no longer knows (a roll-back forgot it) is not an
        error. No actions are carried out from a task being cancelled (no new tasks while the run
        stops)."""
        if not self._router.close(lease_id):
            return  # a roll-back removed it everywhere already
        try:
            actions = self._orchestrator.finish(lease_id)
        except SchedulingError:
            if not forgotten_ok:
                raise
            actions = []
        current = asyncio.current_task()
        if current is None or not current.cancelling():
            self.apply(actions)

    def apply(self, actions: list[Action]) -> None:
        """Carry out orchestrator actions, in order (state at once, RPCs in tasks)."""
        for action in actions:
            match action:
                case Load():
                    if self._orchestrator.mode is Mode.INFLIGHT:
                        self._router.retag(action.instance, action.version)
                    self.on_load(action)
                case Unload():
                    self.on_unload(action)
                case DrainAction(instance=i):
                    self._metrics.write(Drain(instance=i))
                case UndrainAction(
                    instance=i
                ):  # placement asks the orchestrator; this is for the log
                    self._metrics.write(Undrain(instance=i))
                case Migrate(request=rid, dst=dst):
                    if self._router.move(rid, dst):
                        self._spawn(self._router.interrupt(rid, export=True), name=f"move-{rid}")
                case Park(request=rid):
                    if self._router.park(rid):
                        self._spawn(self._router.interrupt(rid, export=False), name=f"park-{rid}")
                case Resume(request=rid, instance=i, version=v):
                    self._router.resume(rid, i, v)
                case Fail(request=rid, reason=reason):
                    self._metrics.write(RequestFailed(lease=rid, reason=reason.value))
                    self._router.fail(rid, reason.value)
        self.changed.set()
        for listener in self.listeners:
            listener()


def _no_loads(load: Load | Unload) -> None:
    raise AssertionError(f"no instance lifecycle to carry out {load}")
