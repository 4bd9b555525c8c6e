"""The orchestrator: which instance holds which version, and where each live request runs.
Pure: no I/O, no clock, no asyncio. The driver feeds it events and carries out the actions it
returns, in order.

Inputs: instances (id, capacity in requests, the version each holds, whether it is loaded), the
live requests of every version (leases: an episode's sample holds its version from its first token
to its end, also while it waits for a tool), and the newest version. Outputs: `Load(instance, w)`,
`Drain(instance)`, `Migrate(request, src, dst)`, `Park(request, instance)` and
`Resume(request, instance, version)`.

Rules (DESIGN.md §5), in mode `dora` (and `sync`, which is `dora` with K = 0):
- an old version keeps the fewest instances that hold its live requests, never zero while it has
  live requests; every other instance serves the newest version;
- instances move only from old versions to the newest, and only when that frees a whole instance:
  the requests of a surplus instance migrate to instances of the *same* version first (C1);
- an instance that dies: its requests migrate to another instance of their version, or are parked;
- a version with parked requests and no room is served in deadline order (oldest version first):
  it takes an empty instance, or else the newest version's least-loaded instance is drained (no new
  groups) and loads it once empty. Parked requests resume as soon as their version has room;
- capacity is never exceeded (`place`, `Migrate` and `Resume` only target free slots).
The driver starts every group through `place`, so it keeps no state of its own about draining.

Mode `one_step_off`: one version at a time. On a new version every instance is drained; once no
live request of the old version is left, all instances load the new one together.
Mode `partial`: on a new version every request is parked (aborted, tokens kept), every instance
loads the new version, and the parked requests resume on it (`Resume.version` is the version that
samples from now on; trajectories span versions, so leases follow the request's current version).

Non-obvious choices:
- A request takes one slot of capacity from its first token to its end, also while it waits for a
  tool: counting only requests inside the engine would let a version be unloaded under a
  multi-turn episode that still needs it.
- `Load` is only emitted for an instance with no requests; the instance is not ready (gets no
  requests) until the driver reports `on_loaded`.
- The one exception to "old to newest only": a version whose requests wait with no room (its
  instance died, or there are fewer instances than live versions) gets an instance back, in
  deadline order, by draining (never preempting) one of the newest version's instances.
- Planning costs O(live versions x instances + parked) per event; a finishing request of the
  newest version with nothing parked or draining skips it (O(1)). Orchestration events are per
  request and per version, not per token, so this is far below the engine's own costs.

Usage::

    o = Orchestrator(mode=Mode.DORA)
    do(o.add_instance("i0", capacity=16))   # -> [Load("i0", 0)]
    do(o.on_loaded("i0", 0))
    where = o.place(["g1/0", "g1/1"], version=0)   # instance id, or None: no room
    do(o.finish("g1/0"))
    do(o.publish(1))                        # StepDone(0): version 1 is the newest
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from dora.errors import SchedulingError

__all__ = [
    "Action",
    "Drain",
    "InstanceView",
    "Load",
    "Migrate",
    "Mode",
    "Orchestrator",
    "Park",
    "Resume",
]


class Mode(enum.Enum):
    SYNC = "sync"
    ONE_STEP_OFF = "one_step_off"
    PARTIAL = "partial"
    DORA = "dora"


@dataclass(frozen=True, slots=True)
class Load:
    """Load `version` on `instance` (it holds no request). Report `on_loaded` when done."""

    instance: str
    version: int


@dataclass(frozen=True, slots=True)
class Drain:
    """Stop placing new groups on `instance`; it switches version once its requests end."""

    instance: str


@dataclass(frozen=True, slots=True)
class Migrate:
    """Move `request` (tokens so far, and its KV cache if the backend can) from `src` to `dst`,
    an instance of the same version. `src` may be an instance that died."""

    request: str
    src: str
    dst: str


@dataclass(frozen=True, slots=True)
class Park:
    """Interrupt `request` on `instance` (abort, keep the tokens so far) until a `Resume`."""

    request: str
    instance: str


@dataclass(frozen=True, slots=True)
class Resume:
    """Continue parked `request` on `instance`, which holds `version` (the request's own version,
    except in partial mode)."""

    request: str
    instance: str
    version: int


Action = Load | Drain | Migrate | Park | Resume


@dataclass(frozen=True, slots=True)
class InstanceView:
    id: str
    capacity: int
    version: int | None
    ready: bool
    draining: bool
    load: int


@dataclass(slots=True)
class _Instance:
    id: str
    capacity: int
    version: int | None = None
    ready: bool = False
    draining: bool = False
    requests: set[str] = field(default_factory=set)

    @property
    def free(self) -> int:
        return self.capacity - len(self.requests)


@dataclass(slots=True)
class _Request:
    version: int
    instance: str | None  # None: parked


class Orchestrator:
    """Versions -> instances. See the module docstring for the rules."""

    def __init__(self, *, mode: Mode = Mode.DORA, newest: int = 0) -> None:
        self._mode = mode
        self._newest = newest
        self._instances: dict[str, _Instance] = {}
        self._requests: dict[str, _Request] = {}
        self._live: dict[int, int] = {}  # version -> live requests (R_w)
        self._parked: dict[int, list[str]] = {}  # version -> parked requests, in park order

    # --- views -------------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def newest(self) -> int:
        return self._newest

    def instances(self) -> list[InstanceView]:
        return [
            InstanceView(i.id, i.capacity, i.version, i.ready, i.draining, len(i.requests))
            for i in self._instances.values()
        ]

    def live(self) -> dict[int, int]:
        """`R_w`: live requests per version (placed or parked)."""
        return {w: n for w, n in sorted(self._live.items()) if n}

    def loaded_versions(self) -> set[int]:
        """Versions held or being loaded by some instance."""
        return {i.version for i in self._instances.values() if i.version is not None}

    def is_live(self, request: str) -> bool:
        return request in self._requests

    def location(self, request: str) -> str | None:
        """The instance running `request`, or None while it is parked."""
        return self._req(request).instance

    def request_version(self, request: str) -> int:
        return self._req(request).version

    # --- events ------------------------------------------------------------------------------

    def add_instance(self, instance_id: str, *, capacity: int) -> list[Action]:
        """A fresh (or recovered) instance joins the pool, empty."""
        if instance_id in self._instances:
            raise SchedulingError(f"instance {instance_id!r} already exists")
        if capacity < 1:
            raise SchedulingError(f"instance capacity must be >= 1, got {capacity}")
        self._instances[instance_id] = _Instance(instance_id, capacity)
        return self._plan()

    def remove_instance(self, instance_id: str) -> list[Action]:
        """The instance died (or was taken away): its requests continue elsewhere."""
        inst = self._instances.pop(instance_id, None)
        if inst is None:
            raise SchedulingError(f"unknown instance {instance_id!r}")
        actions: list[Action] = []
        for rid in sorted(inst.requests):
            req = self._requests[rid]
            dst = self._room(req.version, exclude=instance_id)
            if dst is None:
                req.instance = None
                self._parked.setdefault(req.version, []).append(rid)
                actions.append(Park(rid, instance_id))
            else:
                dst.requests.add(rid)
                req.instance = dst.id
                actions.append(Migrate(rid, instance_id, dst.id))
        return actions + self._plan()

    def on_loaded(self, instance_id: str, version: int) -> list[Action]:
        """A `Load` finished. Ignored if the instance died or was given another version since."""
        inst = self._instances.get(instance_id)
        if inst is None or inst.version != version or inst.ready:
            return []
        inst.ready = True
        return self._plan()

    def publish(self, version: int) -> list[Action]:
        """Version `version` is published and becomes the newest."""
        if version <= self._newest:
            raise SchedulingError(f"version {version} is not newer than {self._newest}")
        self._newest = version
        actions: list[Action] = []
        if self._mode is Mode.ONE_STEP_OFF:
            if any(n for n in self._live.values()):
                for inst in self._instances.values():
                    if inst.version is not None and not inst.draining:
                        inst.draining = True
                        actions.append(Drain(inst.id))
        elif self._mode is Mode.PARTIAL:
            for inst in self._instances.values():
                for rid in sorted(inst.requests):
                    actions.append(Park(rid, inst.id))
                    self._park(rid)
                inst.requests.clear()
        return actions + self._plan()

    def can_place(self, n: int, *, version: int) -> str | None:
        """The instance `place` would choose for `n` requests of `version`, or None. No change."""
        best: _Instance | None = None
        for inst in self._instances.values():
            if (
                inst.version == version
                and inst.ready
                and not inst.draining
                and inst.free >= n
                and (best is None or inst.free > best.free)
            ):
                best = inst
        return None if best is None else best.id

    def place(self, requests: Sequence[str], *, version: int) -> str | None:
        """Start a group's requests together on one ready, non-draining instance of `version`
        with room for all of them (bind late). Returns the instance, or None (nothing changes)."""
        if not requests:
            raise SchedulingError("place needs at least one request")
        where = self.can_place(len(requests), version=version)
        if where is None:
            return None
        best = self._instances[where]
        for rid in requests:
            if rid in self._requests:
                raise SchedulingError(f"request {rid!r} is already live")
            self._requests[rid] = _Request(version, best.id)
            best.requests.add(rid)
        self._live[version] = self._live.get(version, 0) + len(requests)
        return best.id

    def finish(self, request: str) -> list[Action]:
        """The request's lease ended (episode done, failed for good, or aborted)."""
        req = self._requests.pop(request, None)
        if req is None:
            raise SchedulingError(f"unknown request {request!r}")
        self._live[req.version] -= 1
        if req.instance is None:
            self._parked[req.version].remove(request)
        else:
            self._instances[req.instance].requests.discard(request)
        if req.version == self._newest and not self._parked and not self._any_draining():
            return []
        return self._plan()

    def rebalance(self) -> list[Action]:
        """The periodic / KV-pressure trigger: apply the rules again."""
        return self._plan()

    def rollback(self, newest: int) -> list[Action]:
        """The trainer restarted; `newest` (= checkpoint step + 1) is the newest real version.
        Requests of ghost versions (> newest) are forgotten (the driver aborts their groups), and
        instances holding ghosts load `newest`."""
        self._newest = newest
        for rid, req in list(self._requests.items()):
            if req.version > newest:
                del self._requests[rid]
                if req.instance is not None:
                    self._instances[req.instance].requests.discard(rid)
        self._parked = {w: q for w, q in self._parked.items() if w <= newest}
        self._live = {w: n for w, n in self._live.items() if w <= newest}
        for inst in self._instances.values():
            if inst.version is not None and inst.version > newest:
                inst.version, inst.ready, inst.draining = None, False, False
        return self._plan()

    # --- planning ----------------------------------------------------------------------------

    def _plan(self) -> list[Action]:
        actions: list[Action] = []
        if self._mode is Mode.ONE_STEP_OFF:
            self._plan_one_step_off(actions)
        elif self._mode is Mode.PARTIAL:
            for inst in self._instances.values():
                if not inst.requests and inst.version != self._newest:
                    self._load(inst, self._newest, actions)
        else:
            self._plan_multi_version(actions)
        self._resume_parked(actions)
        return actions

    def _plan_one_step_off(self, actions: list[Action]) -> None:
        old = sorted(w for w, n in self._live.items() if n and w != self._newest)
        if not old:
            for inst in self._instances.values():
                inst.draining = False
                if not inst.requests and inst.version != self._newest:
                    self._load(inst, self._newest, actions)
            return
        # The old version drains; an idle instance serves it only if its requests wait for room
        # (an instance died), and otherwise waits to switch with the others.
        for w in old:
            if self._parked.get(w) and self._room(w) is None and not self._loading(w):
                idle = [i for i in self._instances.values() if not i.requests]
                if idle:
                    self._load(min(idle, key=lambda i: i.id), w, actions)

    def _plan_multi_version(self, actions: list[Action]) -> None:
        newest = self._newest
        old = sorted(w for w, n in self._live.items() if n and w != newest)
        keep: set[str] = set()
        for w in old:  # deadline order: the oldest version is on the trainer's critical path
            keep |= self._shrink(w, actions)
        for w in old:
            if self._parked.get(w) and self._room(w) is None:
                self._grow(w, keep, actions)
        for inst in self._instances.values():
            if inst.id in keep or inst.requests:
                continue
            target = newest
            if inst.draining:
                inst.draining = False
                target = self._oldest_waiting(default=newest)
            if inst.version != target:
                self._load(inst, target, actions)

    def _shrink(self, w: int, actions: list[Action]) -> set[str]:
        """Keep the fewest instances of old version `w` that hold its live requests; migrate the
        requests of the others into them, but only off instances that then become empty."""
        mine = sorted(
            (i for i in self._instances.values() if i.version == w),
            key=lambda i: (not i.ready, -len(i.requests), i.id),
        )
        kept: list[_Instance] = []
        room = 0
        need = self._live.get(w, 0)
        for inst in mine:
            if room >= need and not inst.requests:
                continue
            if room >= need and inst.ready:
                free = sum(k.free for k in kept if k.ready)
                if free >= len(inst.requests):
                    for rid in sorted(inst.requests):
                        dst = max((k for k in kept if k.ready), key=lambda k: k.free)
                        dst.requests.add(rid)
                        self._requests[rid].instance = dst.id
                        actions.append(Migrate(rid, inst.id, dst.id))
                    inst.requests.clear()
                    continue
            kept.append(inst)
            room += inst.capacity
        return {k.id for k in kept}

    def _grow(self, w: int, keep: set[str], actions: list[Action]) -> None:
        """Old version `w` has parked requests and no room: give it an instance."""
        if self._loading(w):
            return
        spare = [
            i
            for i in self._instances.values()
            if i.id not in keep and not i.requests and not i.draining
        ]
        if spare:
            inst = min(spare, key=lambda i: (i.version == self._newest and i.ready, i.id))
            keep.add(inst.id)
            if inst.version != w:
                self._load(inst, w, actions)
            return
        if any(i.draining for i in self._instances.values()):
            return  # one is already on its way
        newest = [i for i in self._instances.values() if i.id not in keep and i.requests]
        if newest:
            inst = min(newest, key=lambda i: (len(i.requests), i.id))
            inst.draining = True
            actions.append(Drain(inst.id))

    def _oldest_waiting(self, *, default: int) -> int:
        waiting = [w for w, rs in self._parked.items() if rs and self._room(w) is None]
        return min(waiting, default=default)

    def _resume_parked(self, actions: list[Action]) -> None:
        for w in sorted(self._parked):
            queue = self._parked[w]
            while queue:
                run_on = self._newest if self._mode is Mode.PARTIAL else w
                dst = self._room(run_on)
                if dst is None:
                    break
                rid = queue.pop(0)
                req = self._requests[rid]
                if req.version != run_on:
                    self._live[req.version] -= 1
                    self._live[run_on] = self._live.get(run_on, 0) + 1
                    req.version = run_on
                req.instance = dst.id
                dst.requests.add(rid)
                actions.append(Resume(rid, dst.id, run_on))
        self._parked = {w: q for w, q in self._parked.items() if q}

    # --- helpers -----------------------------------------------------------------------------

    def _req(self, request: str) -> _Request:
        req = self._requests.get(request)
        if req is None:
            raise SchedulingError(f"unknown request {request!r}")
        return req

    def _park(self, rid: str) -> None:
        req = self._requests[rid]
        req.instance = None
        self._parked.setdefault(req.version, []).append(rid)

    def _room(self, version: int, *, exclude: str | None = None) -> _Instance | None:
        best: _Instance | None = None
        for inst in self._instances.values():
            if (
                inst.version == version
                and inst.ready
                and inst.id != exclude
                and inst.free > 0
                and (best is None or inst.free > best.free)
            ):
                best = inst
        return best

    def _loading(self, version: int) -> bool:
        return any(i.version == version and not i.ready for i in self._instances.values())

    def _any_draining(self) -> bool:
        return any(i.draining for i in self._instances.values())

    def _load(self, inst: _Instance, version: int, actions: list[Action]) -> None:
        if inst.requests:
            raise SchedulingError(f"cannot load {inst.id!r}: it holds requests")
        inst.version, inst.ready = version, False
        actions.append(Load(inst.id, version))
