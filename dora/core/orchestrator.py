"""The orchestrator: which instance holds which version, and where each live request runs.
Pure: no I/O, no clock, no asyncio. The driver feeds it events and carries out the actions it
returns, in order.

Inputs: instances (id, capacity in requests, optionally a KV-cache capacity in tokens, the version
each holds, whether it is loaded), the live requests of every version (leases: an episode's sample
holds its version from its first token to its end, also while it waits for a tool) with their
context length when the driver reports it, the newest version, and the driver's demand (samples of
admissible groups waiting for room). Outputs: `Load(instance, w)`, `Drain(instance)`,
`Undrain(instance)`, `Migrate(request, src, dst)`, `Park(request, instance)` and
`Resume(request, instance, version)`. An instance accepts new groups when it is ready and not
draining; `Drain`, `Undrain` and `Load` (which also ends a drain) tell the driver every change.

Rules (docs/scheduling.md), in mode `dora` (and `sync`, which is `dora` with K = 0):
- an old version keeps the fewest instances that hold its live requests, never zero while it has
  live requests; every other instance serves the newest version;
- instances move only from old versions to the newest, and only when that frees a whole instance:
  the requests of a surplus instance migrate to instances of the *same* version first (C1);
- such a consolidation happens only while the newest version needs the room: the driver's demand
  exceeds what the newest version's loading instances will take (always, if no demand was ever
  reported). An old version's instance that empties on its own loads the newest version anyway;
- no migration or resume packs an instance beyond its KV tokens (when it has a token capacity);
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
- Planning is incremental: instances are indexed by version (free slots in a lazy heap, the idle,
  loading and draining ones in sets), so `place` is O(log n), a finishing request is O(1) unless it
  lets a whole instance of its (old) version be freed, and a publish is O(m log m) over the old
  versions' `m` instances. A full pass over the pool happens only while requests are parked or an
  instance drains (an instance died, or fewer instances than versions), which is rare.
- Request sizes are the driver's last report (`set_size`), not live values: they only bound
  packing, and the engine still preempts if a sequence outgrows its instance.
- The module is longer than 600 lines on purpose: the indexes are updated by the same few
  helpers that the rules call, and split apart every rule would have to keep two places in step.

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
import heapq
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
    "Undrain",
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
class Undrain:
    """`instance` accepts new groups again: a drain ended without a version switch (a `Load`
    also ends a drain; the instance accepts groups once `on_loaded` is reported)."""

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


Action = Load | Drain | Undrain | Migrate | Park | Resume


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
    order: int  # join order: ties between equally free instances go to the older one
    tokens: int | None = None  # KV-cache capacity in tokens (None: not limited)
    version: int | None = None
    ready: bool = False
    draining: bool = False
    requests: set[str] = field(default_factory=set)
    used_tokens: int = 0

    @property
    def free(self) -> int:
        return self.capacity - len(self.requests)

    def fits(self, size: int) -> bool:
        """Room for one more request of `size` context tokens."""
        return self.free > 0 and (self.tokens is None or self.used_tokens + size <= self.tokens)


@dataclass(slots=True)
class _Request:
    version: int
    instance: str | None  # None: parked
    size: int = 0  # context tokens, as last reported by the driver (`set_size`)


class Orchestrator:
    """Versions -> instances. See the module docstring for the rules."""

    def __init__(self, *, mode: Mode = Mode.DORA, newest: int = 0) -> None:
        self._mode = mode
        self._newest = newest
        self._instances: dict[str, _Instance] = {}
        self._requests: dict[str, _Request] = {}
        self._live: dict[int, int] = {}  # version -> live requests (R_w)
        self._parked: dict[int, list[str]] = {}  # version -> parked requests, in park order
        self._demand: int | None = None  # requests waiting for room (None: not reported)
        self._joined = 0
        self._min_capacity = 0
        # Indexes, so that an event costs about O(log n) rather than a pass over the pool:
        self._by_version: dict[int | None, dict[str, _Instance]] = {}
        self._empty: dict[int | None, dict[str, None]] = {}  # version -> instances with no request
        self._loading: dict[int, dict[str, None]] = {}  # version -> instances loading it
        self._loading_slots: dict[int, int] = {}  # version -> capacity of those instances
        self._slots: dict[int | None, int] = {}  # version -> capacity of its instances
        self._used: dict[int | None, int] = {}  # version -> requests on its instances
        self._draining: dict[str, None] = {}
        self._heaps: dict[int, list[tuple[int, int, str]]] = {}  # (-free, order, id), lazy

    # --- views -------------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def newest(self) -> int:
        return self._newest

    @property
    def demand(self) -> int | None:
        return self._demand

    def instances(self) -> list[InstanceView]:
        return [
            InstanceView(i.id, i.capacity, i.version, i.ready, i.draining, len(i.requests))
            for i in self._instances.values()
        ]

    def accepts(self, instance_id: str) -> bool:
        """Whether `place` may start groups on the instance: ready and not draining."""
        inst = self._instances.get(instance_id)
        return inst is not None and inst.ready and not inst.draining

    def live(self) -> dict[int, int]:
        """`R_w`: live requests per version (placed or parked)."""
        return {w: n for w, n in sorted(self._live.items()) if n}

    def loaded_versions(self) -> set[int]:
        """Versions held or being loaded by some instance."""
        return {w for w, d in self._by_version.items() if d and w is not None}

    def is_live(self, request: str) -> bool:
        return request in self._requests

    def location(self, request: str) -> str | None:
        """The instance running `request`, or None while it is parked."""
        return self._req(request).instance

    def request_version(self, request: str) -> int:
        return self._req(request).version

    # --- events ------------------------------------------------------------------------------

    def add_instance(
        self, instance_id: str, *, capacity: int, tokens: int | None = None
    ) -> list[Action]:
        """A fresh (or recovered) instance joins the pool, empty. `tokens`: its KV-cache capacity
        in context tokens; when given, consolidation never packs more than that onto it."""
        if instance_id in self._instances:
            raise SchedulingError(f"instance {instance_id!r} already exists")
        if capacity < 1:
            raise SchedulingError(f"instance capacity must be >= 1, got {capacity}")
        if tokens is not None and tokens < 1:
            raise SchedulingError(f"instance token capacity must be >= 1, got {tokens}")
        self._joined += 1
        inst = _Instance(instance_id, capacity, self._joined, tokens)
        self._instances[instance_id] = inst
        self._min_capacity = min(self._min_capacity or capacity, capacity)
        self._index(inst)
        return self._plan()

    def remove_instance(self, instance_id: str) -> list[Action]:
        """The instance died (or was taken away): its requests continue elsewhere."""
        inst = self._instances.get(instance_id)
        if inst is None:
            raise SchedulingError(f"unknown instance {instance_id!r}")
        self._unindex(inst)
        del self._instances[instance_id]
        self._set_draining(inst, False)
        actions: list[Action] = []
        for rid in sorted(inst.requests):
            req = self._requests[rid]
            dst = self._room(req.version, req.size)
            if dst is None:
                req.instance = None
                self._parked.setdefault(req.version, []).append(rid)
                actions.append(Park(rid, instance_id))
            else:
                self._attach(dst, rid)
                actions.append(Migrate(rid, instance_id, dst.id))
        return actions + self._plan()

    def on_loaded(self, instance_id: str, version: int) -> list[Action]:
        """A `Load` finished. Ignored if the instance died or was given another version since."""
        inst = self._instances.get(instance_id)
        if inst is None or inst.version != version or inst.ready:
            return []
        self._unindex(inst)
        inst.ready = True
        self._index(inst)
        if version == self._newest and not self._parked and not self._draining:
            return []  # a ready instance of the newest version changes no other decision
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
                        self._set_draining(inst, True)
                        actions.append(Drain(inst.id))
        elif self._mode is Mode.PARTIAL:
            for inst in self._instances.values():
                for rid in sorted(inst.requests):
                    actions.append(Park(rid, inst.id))
                    self._detach(inst, rid)
                    self._park(rid)
        return actions + self._plan()

    def set_demand(self, requests: int) -> list[Action]:
        """The driver's admission backlog: `requests` samples of admissible groups wait because no
        instance has room for them (0: none wait). Once reported, an old version is consolidated
        (its requests migrated to free a whole instance for the newest version) only while this
        exceeds the room that the newest version's loading instances will bring; a driver that
        never reports it gets consolidation whenever it frees an instance."""
        if requests < 0:
            raise SchedulingError(f"demand must be >= 0, got {requests}")
        before = self._consolidating()
        self._demand = requests
        if self._consolidating() and not before:
            return self._plan()
        return []

    def set_size(self, request: str, tokens: int) -> None:
        """The request's context is now `tokens` long (what it holds of an instance's KV cache).
        Reported by the driver when it knows it; used only against instances' token capacity."""
        req = self._req(request)
        if req.instance is not None:
            self._instances[req.instance].used_tokens += tokens - req.size
        req.size = tokens

    def can_place(self, n: int, *, version: int) -> str | None:
        """The instance `place` would choose for `n` requests of `version`, or None. No change."""
        best = self._most_free(version, accepting=True)
        return None if best is None or best.free < n else best.id

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
            self._requests[rid] = _Request(version, None)
            self._attach(best, rid)
        self._live[version] = self._live.get(version, 0) + len(requests)
        return best.id

    def finish(self, request: str) -> list[Action]:
        """The request's lease ended (episode done, failed for good, or aborted)."""
        req = self._requests.get(request)
        if req is None:
            raise SchedulingError(f"unknown request {request!r}")
        inst = None if req.instance is None else self._instances[req.instance]
        if inst is None:
            self._parked[req.version].remove(request)
        else:
            self._detach(inst, request)
        del self._requests[request]
        self._live[req.version] -= 1
        if self._parked or self._draining or self._mode not in (Mode.DORA, Mode.SYNC):
            return self._plan()
        if req.version == self._newest or inst is None:
            return []
        # An old version's request ended and nothing waits: only its own version can change.
        if not inst.requests:
            # Nothing is parked, so the version's other requests sit on other instances: this
            # one is surplus (the rule's "fewest instances" never keeps an empty one).
            actions: list[Action] = []
            self._load(inst, self._newest, actions)
            return actions
        if self._spare(req.version) >= self._min_capacity and self._consolidating():
            return self._plan()
        return []

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
                if req.instance is not None:
                    self._detach(self._instances[req.instance], rid)
                del self._requests[rid]
        self._parked = {w: q for w, q in self._parked.items() if w <= newest}
        self._live = {w: n for w, n in self._live.items() if w <= newest}
        for inst in list(self._instances.values()):
            if inst.version is not None and inst.version > newest:
                self._unindex(inst)
                inst.version, inst.ready = None, False
                self._index(inst)
                self._set_draining(inst, False)
        return self._plan()

    # --- planning ----------------------------------------------------------------------------

    def _plan(self) -> list[Action]:
        actions: list[Action] = []
        if self._mode is Mode.ONE_STEP_OFF:
            self._plan_one_step_off(actions)
        elif self._mode is Mode.PARTIAL:
            for inst in self._idle_not_newest():
                self._load(inst, self._newest, actions)
        else:
            self._plan_multi_version(actions)
        self._resume_parked(actions)
        return actions

    def _plan_one_step_off(self, actions: list[Action]) -> None:
        old = sorted(w for w, n in self._live.items() if n and w != self._newest)
        if not old:
            for inst in [self._instances[i] for i in self._draining]:
                self._set_draining(inst, False)
                if inst.version == self._newest:
                    actions.append(Undrain(inst.id))
            for inst in self._idle_not_newest():
                self._load(inst, self._newest, actions)
            return
        # The old version drains; an idle instance serves it only if its requests wait for room
        # (an instance died), and otherwise waits to switch with the others.
        for w in old:
            if self._parked.get(w) and self._room(w) is None and not self._loading.get(w):
                idle = [i for v in self._empty for i in self._empty[v]]
                if idle:
                    self._load(self._instances[min(idle)], w, actions)

    def _plan_multi_version(self, actions: list[Action]) -> None:
        newest = self._newest
        old = sorted(w for w, n in self._live.items() if n and w != newest)
        keep: set[str] = set()
        for w in old:  # deadline order: the oldest version is on the trainer's critical path
            keep |= self._shrink(w, actions)
        for w in old:
            if self._parked.get(w) and self._room(w) is None:
                self._grow(w, keep, actions)
        todo = {i.id: i for i in self._idle_not_newest()}
        todo.update((i, self._instances[i]) for i in self._draining)
        for inst in sorted(todo.values(), key=lambda i: i.order):
            if inst.id in keep or inst.requests or inst.id not in self._instances:
                continue
            target = newest
            if inst.draining:
                self._set_draining(inst, False)
                target = self._oldest_waiting(default=newest)
                if inst.version == target:
                    actions.append(Undrain(inst.id))
            if inst.version != target:
                self._load(inst, target, actions)

    def _shrink(self, w: int, actions: list[Action]) -> set[str]:
        """Keep the fewest instances of old version `w` that hold its live requests; migrate the
        requests of the others into them, but only off instances that then become empty, only
        into free slots and free KV tokens, and only while the newest version needs the room."""
        mine = self._by_version.get(w, {})
        empty = self._empty.get(w, {})
        migrate = self._consolidating() and self._spare(w) >= self._min_capacity
        if not migrate and not empty:
            return set(mine)  # nothing can move and nothing is idle: every instance stays
        order = sorted(mine.values(), key=lambda i: (not i.ready, -len(i.requests), i.id))
        kept: list[_Instance] = []
        room = 0
        need = self._live.get(w, 0)
        for inst in order:
            if room >= need and not inst.requests:
                continue
            if migrate and room >= need and inst.ready and self._move_all(inst, kept, actions):
                continue
            kept.append(inst)
            room += inst.capacity
        return {k.id for k in kept}

    def _move_all(self, inst: _Instance, kept: list[_Instance], actions: list[Action]) -> bool:
        """Migrate every request of `inst` into `kept` (largest first, each to the instance with
        the most free slots that also has the KV tokens), or move none and return False."""
        targets = [k for k in kept if k.ready]
        if sum(k.free for k in targets) < len(inst.requests):
            return False
        plan: list[tuple[str, _Instance]] = []
        free = {k.id: k.free for k in targets}
        tokens = {k.id: k.used_tokens for k in targets}
        for rid in sorted(inst.requests, key=lambda r: (-self._requests[r].size, r)):
            size = self._requests[rid].size
            fit = [
                k
                for k in targets
                if free[k.id] > 0 and (k.tokens is None or tokens[k.id] + size <= k.tokens)
            ]
            if not fit:
                return False
            dst = max(fit, key=lambda k: free[k.id])
            free[dst.id] -= 1
            tokens[dst.id] += size
            plan.append((rid, dst))
        for rid, dst in sorted(plan):
            self._detach(inst, rid)
            self._attach(dst, rid)
            actions.append(Migrate(rid, inst.id, dst.id))
        return True

    def _grow(self, w: int, keep: set[str], actions: list[Action]) -> None:
        """Old version `w` has parked requests and no room: give it an instance."""
        if self._loading.get(w):
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
        if self._draining:
            return  # one is already on its way
        newest = [i for i in self._instances.values() if i.id not in keep and i.requests]
        if newest:
            inst = min(newest, key=lambda i: (len(i.requests), i.id))
            self._set_draining(inst, True)
            actions.append(Drain(inst.id))

    def _oldest_waiting(self, *, default: int) -> int:
        waiting = [w for w, rs in self._parked.items() if rs and self._room(w) is None]
        return min(waiting, default=default)

    def _resume_parked(self, actions: list[Action]) -> None:
        for w in sorted(self._parked):
            queue = self._parked[w]
            while queue:
                run_on = self._newest if self._mode is Mode.PARTIAL else w
                rid = queue[0]
                req = self._requests[rid]
                dst = self._room(run_on, req.size)
                if dst is None:
                    break
                queue.pop(0)
                if req.version != run_on:
                    self._live[req.version] -= 1
                    self._live[run_on] = self._live.get(run_on, 0) + 1
                    req.version = run_on
                self._attach(dst, rid)
                actions.append(Resume(rid, dst.id, run_on))
        self._parked = {w: q for w, q in self._parked.items() if q}

    def _consolidating(self) -> bool:
        """Whether freeing an old version's instance pays: the driver never reported its demand,
        or more requests wait than the newest version's loading instances will take."""
        if self._demand is None:
            return True
        return self._demand > self._loading_slots.get(self._newest, 0)

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

    def _spare(self, version: int) -> int:
        """Free slots on the instances of `version`."""
        return self._slots.get(version, 0) - self._used.get(version, 0)

    def _idle_not_newest(self) -> list[_Instance]:
        """Empty instances that hold (or load) another version than the newest, in join order."""
        idle = [
            self._instances[i] for v, ids in self._empty.items() if v != self._newest for i in ids
        ]
        return sorted(idle, key=lambda i: i.order)

    def _room(self, version: int, size: int = 0) -> _Instance | None:
        """The ready instance of `version` with the most free slots that fits a request of `size`
        context tokens (draining ones included: they still run their own version)."""
        best = self._most_free(version, accepting=False)
        if best is None or best.fits(size):
            return best
        fit = [i for i in self._by_version.get(version, {}).values() if i.ready and i.fits(size)]
        return min(fit, key=lambda i: (-i.free, i.order), default=None)

    def _most_free(self, version: int, *, accepting: bool) -> _Instance | None:
        """The ready instance of `version` with the most free slots (the oldest on ties), from a
        lazy heap: entries that no longer describe their instance are dropped when met."""
        heap = self._heaps.get(version)
        if not heap:
            return None
        skipped: list[tuple[int, int, str]] = []
        best = None
        while heap:
            neg, order, iid = heap[0]
            inst = self._instances.get(iid)
            if (
                inst is None
                or inst.order != order
                or inst.version != version
                or not inst.ready
                or inst.free != -neg
            ):
                heapq.heappop(heap)
                continue
            if accepting and inst.draining:
                skipped.append(heapq.heappop(heap))
                continue
            best = inst if inst.free > 0 else None
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return best

    def _push(self, inst: _Instance) -> None:
        if inst.version is None or not inst.ready:
            return
        heap = self._heaps.setdefault(inst.version, [])
        heapq.heappush(heap, (-inst.free, inst.order, inst.id))
        if len(heap) > 4 * len(self._by_version.get(inst.version, {})) + 64:
            live = self._by_version.get(inst.version, {}).values()
            heap[:] = [(-i.free, i.order, i.id) for i in live if i.ready]
            heapq.heapify(heap)

    def _index(self, inst: _Instance) -> None:
        v = inst.version
        self._by_version.setdefault(v, {})[inst.id] = inst
        self._slots[v] = self._slots.get(v, 0) + inst.capacity
        self._used[v] = self._used.get(v, 0) + len(inst.requests)
        if not inst.requests:
            self._empty.setdefault(v, {})[inst.id] = None
        if v is not None and not inst.ready:
            self._loading.setdefault(v, {})[inst.id] = None
            self._loading_slots[v] = self._loading_slots.get(v, 0) + inst.capacity
        self._push(inst)

    def _unindex(self, inst: _Instance) -> None:
        v = inst.version
        del self._by_version[v][inst.id]
        self._slots[v] -= inst.capacity
        self._used[v] -= len(inst.requests)
        if not self._by_version[v]:
            del self._by_version[v]
        empty = self._empty.get(v)
        if empty is not None:
            empty.pop(inst.id, None)
            if not empty:
                del self._empty[v]
        loading = None if v is None else self._loading.get(v)
        if v is not None and loading is not None and inst.id in loading:
            del loading[inst.id]
            self._loading_slots[v] -= inst.capacity
            if not loading:
                del self._loading[v]

    def _attach(self, inst: _Instance, rid: str) -> None:
        req = self._requests[rid]
        if not inst.requests:
            empty = self._empty[inst.version]
            del empty[inst.id]
            if not empty:
                del self._empty[inst.version]
        inst.requests.add(rid)
        inst.used_tokens += req.size
        req.instance = inst.id
        self._used[inst.version] += 1
        self._push(inst)

    def _detach(self, inst: _Instance, rid: str) -> None:
        inst.requests.discard(rid)
        inst.used_tokens -= self._requests[rid].size
        self._used[inst.version] -= 1
        if not inst.requests:
            self._empty.setdefault(inst.version, {})[inst.id] = None
        self._push(inst)

    def _set_draining(self, inst: _Instance, draining: bool) -> None:
        inst.draining = draining
        if draining:
            self._draining[inst.id] = None
        else:
            self._draining.pop(inst.id, None)

    def _load(self, inst: _Instance, version: int, actions: list[Action]) -> None:
        if inst.requests:
            raise SchedulingError(f"cannot load {inst.id!r}: it holds requests")
        self._unindex(inst)
        inst.version, inst.ready = version, False
        self._index(inst)
        actions.append(Load(inst.id, version))
