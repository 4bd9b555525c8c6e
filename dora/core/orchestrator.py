"""The orchestrator: which instance holds which version, and where each live request runs.
Pure: no I/O, no clock, no asyncio. The driver feeds it events and carries out the actions it
returns, in order.

Inputs: instances (id, capacity in requests, optionally a KV-cache capacity in tokens, the version
each holds, whether it is loaded), the live requests of every version (leases: an episode's sample
holds its version from its first token to its end, also while it waits for a tool) with their
context length when the driver reports it, the newest version, and the driver's demand (samples of
admissible groups waiting for room). Outputs (`actions.py`): `Load(instance, w, id)`,
`Drain(instance)`, `Undrain(instance)`, `Migrate(request, src, dst)`, `Park(request, instance)`,
`Resume(request, instance, version)`, `Fail(request, reason)` and `Unload(instance, w)`. An
instance accepts new groups when it is ready and not draining; `Drain`, `Undrain` and `Load`
(which also ends a drain) tell the driver every change. The state and its indexes are kept by
`pool.py`; this module holds the rules.

The driver's contract (docs/scheduling.md): a load is answered by handing the very `Load` back
to `on_loaded` (its `id` tells a superseded load's completion apart: it is ignored and counted);
a `Fail`ed request is ended by the driver and then `finish`ed; a trainer restart goes through
`dora.core.rollback` (queue first, then `rollback(newest, forget=...)`, nothing in between).

Rules, in mode `dora` (and `sync`, which is `dora` with K = 0):
- an old version keeps the fewest instances that hold its live requests, never zero while it has
  live requests; every other instance serves the newest version;
- instances move only from old versions to the newest, and only when that frees a whole instance:
  the requests of a surplus instance migrate to instances of the *same* version first (C1);
- such a consolidation happens only while the newest version needs the room: the driver's demand
  exceeds what the newest version's loading instances (and those the plan freed) will take, so one
  waiting group frees one instance (always, if no demand was ever reported). An old version's
  instance that empties on its own loads the newest version anyway;
- no migration or resume packs an instance beyond its KV tokens (when it has a token capacity),
  and an old version keeps instances enough for its live requests by slots *and* by tokens; a
  request longer than every instance's token capacity fails (`Fail`, `FailReason.TOO_LONG`);
- an instance that dies: its requests migrate to another instance of their version, or are parked;
- a version with parked requests and no room is served in deadline order (oldest version first):
  in one plan it takes as many empty instances as its parked requests need beside the ones
  already loading it (the queue packed as it would resume: in park order, by slots and KV
  tokens), or else the newest version's least-loaded instance is drained (no new groups) and
  loads it once empty, unless the instances loading it will hold its parked requests by then.
  Parked requests resume as soon as their version has room, and before any idle instance is
  re-targeted, so an instance is never loaded and released in turn;
- an instance is told to load at most once per change of the inputs: a publish, a roll-back,
  an instance added or removed, a request placed, resized (to another size) or ended, a demand
  of another value. A load completion (or `rebalance`) alone changes none, so the plans it
  starts never re-target an instance told to load since the last change. The rules above keep
  this by themselves; as a backstop a plan that would break it leaves the instance as it is
  until the next change (counted in `held_back_loads`);
- capacity is never exceeded (`place`, `Migrate` and `Resume` only target free slots);
- a multi-version instance (`add_instance(multi_version=True)`: versions as adapters) loads each
  new version beside those it holds, with its requests running (no drain, no consolidation), takes
  requests of every version it holds, and gets `Unload(instance, w)` once no lease of `w` is left
  (never the newest, nor version 0, the base).
The driver starts every group through `place`, so it keeps no state of its own about draining.

On a new version, mode `one_step_off` drains every instance and, once the old version has no live
request, loads the new one on all together; `partial` parks every request (aborted, tokens kept),
loads every instance and resumes them on it (`Resume.version` samples from now on: leases follow
a request's current version); `inflight` loads every instance under its running requests, which
go on with the KV cache the old weights made, their leases moved to the new version at once.

Non-obvious choices:
- A request takes one slot from its first token to its end, also while it waits for a tool:
  else a version could be unloaded under a multi-turn episode that still needs it.
- `Load` is only emitted for an instance with no requests (but in mode `inflight`); the instance
  gets no new requests until the driver reports `on_loaded`.
- The one exception to "old to newest only": a version whose requests wait with no room (its
  instance died, or there are fewer instances than live versions) gets an instance back, in
  deadline order, by draining (never preempting) one of the newest version's instances.
- Planning is incremental (`pool.py`): `place` is O(log n), a finishing request O(1) unless it
  frees a whole old instance, a publish O(m log m) over the old versions' `m` instances; a full
  pass only while requests are parked or an instance drains (rare).
- Request sizes are the driver's last report (`set_size`): they only bound packing (the engine
  still preempts a sequence that outgrows its instance).

Usage::

    o = Orchestrator(mode=Mode.DORA)
    [load] = o.add_instance("i0", capacity=16)   # -> [Load("i0", 0, id=1)]
    do(o.on_loaded(load))                   # the same `Load`, once its weights are in
    where = o.place(["g1/0", "g1/1"], version=0)   # instance id, or None: no room
    do(o.finish("g1/0"))
    do(o.publish(1))                        # StepDone(0): version 1 is the newest
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from dora.core.actions import (
    Action,
    Drain,
    Fail,
    FailReason,
    InstanceView,
    Load,
    Migrate,
    Mode,
    Park,
    Resume,
    Undrain,
    Unload,
)
from dora.core.pool import _UNLIMITED, Pool, _Instance, _Request
from dora.errors import SchedulingError

# The action types are re-exported: a driver may import everything from this module.
__all__ = [
    "Action",
    "Drain",
    "Fail",
    "FailReason",
    "InstanceView",
    "Load",
    "Migrate",
    "Mode",
    "Orchestrator",
    "Park",
    "Resume",
    "Undrain",
    "Unload",
]


class Orchestrator(Pool):
    """Versions -> instances. See the module docstring for the rules."""

    def __init__(self, *, mode: Mode = Mode.DORA, newest: int = 0) -> None:
        super().__init__(mode=mode, newest=newest)

    # --- events ------------------------------------------------------------------------------

    def add_instance(
        self,
        instance_id: str,
        *,
        capacity: int,
        tokens: int | None = None,
        multi_version: bool = False,
    ) -> list[Action]:
        """A fresh (or recovered) instance joins the pool, empty. `tokens`: its KV-cache capacity
        in context tokens; when given, consolidation never packs more than that onto it.
        `multi_version`: it holds several versions at once (as adapters over one base model), so
        in modes `dora` and `sync` it loads each new version beside the ones its requests still
        use, and serves them all from shared slots (see "Multi-version instances" in
        docs/scheduling.md); in the other modes it is treated as a single-version instance."""
        if instance_id in self._instances:
            raise SchedulingError(f"instance {instance_id!r} already exists")
        if capacity < 1:
            raise SchedulingError(f"instance capacity must be >= 1, got {capacity}")
        if tokens is not None and tokens < 1:
            raise SchedulingError(f"instance token capacity must be >= 1, got {tokens}")
        self._changed()
        self._joined += 1
        inst = _Instance(instance_id, capacity, self._joined, tokens)
        if multi_version and self._mode in (Mode.DORA, Mode.SYNC):
            inst.held = set()
            self._multi[instance_id] = inst
        self._instances[instance_id] = inst
        self._min_capacity = min(self._min_capacity or capacity, capacity)
        self._token_caps[tokens] = self._token_caps.get(tokens, 0) + 1
        self._index(inst)
        actions: list[Action] = []
        self._fail_parked_too_long(actions)  # into an empty pool: its first capacity counts
        return actions + self._plan()

    def remove_instance(self, instance_id: str) -> list[Action]:
        """The instance died (or was taken away): its requests continue elsewhere."""
        inst = self._instances.get(instance_id)
        if inst is None:
            raise SchedulingError(f"unknown instance {instance_id!r}")
        self._changed()
        self._unindex(inst)
        del self._instances[instance_id]
        self._multi.pop(instance_id, None)
        self._token_caps[inst.tokens] -= 1
        if not self._token_caps[inst.tokens]:
            del self._token_caps[inst.tokens]
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
        self._fail_parked_too_long(actions)  # the largest KV cache may have gone with it
        return actions + self._plan()

    def on_loaded(self, load: Load) -> list[Action]:
        """`load` finished. Ignored (and counted in `stale_loads`) unless it is the instance's
        pending load (`pending_load`): the instance died, or got another `Load` since."""
        inst = self._instances.get(load.instance)
        if inst is not None and inst.held is not None:
            return self._on_added(inst, load)
        if inst is None or inst.ready or inst.load_id != load.id or inst.version != load.version:
            self._stale_loads += 1
            return []
        self._unindex(inst)
        inst.ready = True
        inst.load_id = 0
        self._index(inst)
        if load.version == self._newest and not self._parked and not self._draining:
            return []  # a ready instance of the newest version changes no other decision
        return self._plan()

    def _on_added(self, inst: _Instance, load: Load) -> list[Action]:
        """A load onto multi-version `inst` finished: it holds one more version (and serves it at
        once); versions no request needs any more are unloaded."""
        if not self._added(inst, load):
            return []
        actions: list[Action] = []
        self._drop_unused(inst, actions)
        return actions + self._plan()

    def publish(self, version: int) -> list[Action]:
        """Version `version` is published and becomes the newest."""
        if version <= self._newest:
            raise SchedulingError(f"version {version} is not newer than {self._newest}")
        self._changed()
        self._newest = version
        actions: list[Action] = []
        if self._mode is Mode.ONE_STEP_OFF:
            if self._live:
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
        elif self._mode is Mode.INFLIGHT:
            for inst in [i for i in self._instances.values() if i.version is not None]:
                self._swap(inst, version, actions)
        return actions + self._plan()

    def set_demand(self, requests: int) -> list[Action]:
        """The driver's admission backlog: `requests` samples of admissible groups wait because no
        instance has room for them (0: none wait). Once reported, an old version is consolidated
        (its requests migrated to free a whole instance for the newest version) only while this
        exceeds the room that the newest version's loading instances will bring; a driver that
        never reports it gets consolidation whenever it frees an instance."""
        if requests < 0:
            raise SchedulingError(f"demand must be >= 0, got {requests}")
        if requests == self._demand:
            return []
        self._changed()
        before = self._consolidating()
        self._demand = requests
        if self._consolidating() and not before:
            return self._plan()
        return []

    def set_size(self, request: str, tokens: int) -> list[Action]:
        """The request's context is now `tokens` long (what it holds of an instance's KV cache).
        Reported by the driver when it knows it; used only against instances' token capacity.
        A request longer than every instance's capacity fails (`Fail`, `FailReason.TOO_LONG`)."""
        if tokens < 0:
            raise SchedulingError(f"request {request!r}: size must be >= 0 tokens, got {tokens}")
        req = self._req(request)
        if tokens != req.size:
            self._changed()
        if req.instance is not None:
            self._instances[req.instance].used_tokens += tokens - req.size
        self._count_live(req.version, 0, tokens - req.size)
        req.size = tokens
        if req.failed or not self._too_long(tokens):
            return []
        actions: list[Action] = []
        self._fail(request, FailReason.TOO_LONG, actions)
        return actions + self._plan()

    def can_place(self, n: int, *, version: int) -> str | None:
        """The instance `place` would choose for `n` requests of `version`, or None. No change."""
        best = self._most_free(version, accepting=True)
        if best is None or best.free < n:
            best = self._holder(version, n, 0) if self._multi else None
        return None if best is None else best.id

    def place(self, requests: Sequence[str], *, version: int) -> str | None:
        """Start a group's requests together on one ready, non-draining instance of `version` (or
        a multi-version instance holding it)
        with room for all of them (bind late). Returns the instance, or None (nothing changes)."""
        if not requests:
            raise SchedulingError("place needs at least one request")
        where = self.can_place(len(requests), version=version)
        if where is None:
            return None
        self._changed()
        best = self._instances[where]
        for rid in requests:
            if rid in self._requests:
                raise SchedulingError(f"request {rid!r} is already live")
            self._requests[rid] = _Request(version, None)
            self._attach(best, rid)
        self._count_live(version, len(requests), 0)
        return best.id

    def finish(self, request: str) -> list[Action]:
        """The request's lease ended (episode done, failed for good, or aborted)."""
        req = self._requests.get(request)
        if req is None:
            raise SchedulingError(f"unknown request {request!r}")
        self._changed()
        inst = None if req.instance is None else self._instances[req.instance]
        if inst is None:
            if not req.failed:
                self._parked[req.version].remove(request)
        else:
            self._detach(inst, request)
        del self._requests[request]
        self._count_live(req.version, -1, -req.size)
        actions: list[Action] = []
        if req.version not in self._live:  # its version's last lease: no adapter of it is needed
            for holder in self._multi.values():
                if holder.held is not None and req.version in holder.held:
                    self._drop_unused(holder, actions)
        if (
            inst is None
            or self._parked
            or self._draining
            or self._deferred
            or self._mode not in (Mode.DORA, Mode.SYNC)
        ):
            return actions + self._plan()  # a parked request's end may leave a load unneeded
        if req.version == self._newest or inst.held is not None:
            return actions
        # An old version's request ended and nothing waits: only its own version can change.
        if not inst.requests:
            # Nothing is parked, so the version's other requests sit on other instances: this
            # one is surplus (the rule's "fewest instances" never keeps an empty one).
            self._load(inst, self._newest, actions)
            return actions
        if self._spare(req.version) >= self._min_capacity and self._consolidating():
            return actions + self._plan()
        return actions

    def rebalance(self) -> list[Action]:
        """The periodic / KV-pressure trigger: apply the rules again."""
        return self._plan()

    def rollback(self, newest: int, *, forget: Collection[str] = ()) -> list[Action]:
        """The trainer restarted; `newest` (the checkpoint's step + 1) is the newest real
        version. Requests of ghost versions (> newest) are forgotten, and so are those named in
        `forget`: the live requests of every group the queue rolled back (in partial mode a
        group of a real first version may hold ghost tokens); names that already ended are
        skipped. Instances holding ghosts load `newest`. Nothing is planned before all of it is
        forgotten, so call it right after `TransferQueue.rollback`, with no other event in
        between (a `finish` there would resume parked requests on a ghost): `dora.core.rollback`
        does both in this order."""
        if newest < 0:
            raise SchedulingError(f"rollback to version {newest}: versions are >= 0")
        drop = set(forget)
        self._changed()
        self._newest = newest
        for rid, req in list(self._requests.items()):
            if req.version > newest or rid in drop:
                if req.instance is not None:
                    self._detach(self._instances[req.instance], rid)
                del self._requests[rid]
                self._count_live(req.version, -1, -req.size)
        self._parked = {
            w: kept
            for w, q in self._parked.items()
            if (kept := [r for r in q if r in self._requests])
        }
        actions: list[Action] = []
        self._forget_ghost_versions(newest, actions)
        for inst in list(self._instances.values()):
            if inst.version is not None and inst.version > newest:
                self._unindex(inst)
                inst.version, inst.ready, inst.load_id = None, False, 0
                self._index(inst)
                self._set_draining(inst, False)
        return actions + self._plan()

    # --- planning ----------------------------------------------------------------------------

    def _plan(self) -> list[Action]:
        actions: list[Action] = []
        self._deferred = False
        if self._mode is Mode.ONE_STEP_OFF:
            self._plan_one_step_off(actions)
        elif self._mode in (Mode.PARTIAL, Mode.INFLIGHT):
            for inst in self._idle_not_newest():
                if self._retargetable(inst):
                    self._load(inst, self._newest, actions)
        else:
            self._plan_multi_version(actions)
            return actions
        self._resume_parked(actions)
        return actions

    def _plan_one_step_off(self, actions: list[Action]) -> None:
        old = sorted(w for w in self._live if w != self._newest)
        if not old:
            for inst in [self._instances[i] for i in self._draining]:
                self._set_draining(inst, False)
                if inst.version == self._newest:
                    actions.append(Undrain(inst.id))
            for inst in self._idle_not_newest():
                if self._retargetable(inst):
                    self._load(inst, self._newest, actions)
            return
        # The old version drains; an idle instance serves it only if its requests wait for room
        # (an instance died), and otherwise waits to switch with the others.
        for w in old:
            if self._parked.get(w) and self._room(w) is None and not self._loading.get(w):
                idle = sorted(i for v in self._empty for i in self._empty[v])
                pick = next((i for i in idle if self._retargetable(self._instances[i])), None)
                if pick is not None:
                    self._load(self._instances[pick], w, actions)

    def _plan_multi_version(self, actions: list[Action]) -> None:
        newest = self._newest
        for inst in self._multi.values():  # the newest version joins what they hold, no drain
            if inst.held is not None and newest not in inst.held and newest not in inst.adding:
                self._add_version(inst, newest, actions)
        old = sorted(w for w in self._live if w != newest)
        keep: set[str] = set()
        for w in old:  # deadline order: the oldest version is on the trainer's critical path
            keep |= self._shrink(w, actions)
        # Parked requests take the room they have before any instance is re-targeted: an idle
        # instance of their version is room, not a surplus to load the newest version on.
        self._resume_parked(actions)
        for w in old:
            if self._parked.get(w):  # what is still parked has no room
                self._grow(w, keep, actions)
        todo = {i.id: i for i in self._idle_not_newest()}
        todo.update((i, self._instances[i]) for i in self._draining)
        for inst in sorted(todo.values(), key=lambda i: i.order):
            if inst.id in keep or inst.requests or inst.id not in self._instances:
                continue
            if not self._retargetable(inst):
                continue  # told to load since the inputs changed: no second load for one change
            target = newest
            if inst.draining:
                self._set_draining(inst, False)
                target = self._oldest_waiting(default=newest)
                if inst.version == target:
                    actions.append(Undrain(inst.id))
            if inst.version != target:
                self._load(inst, target, actions)
        self._freed_slots = 0  # `_consolidating` counts it only while a plan is made

    def _shrink(self, w: int, actions: list[Action]) -> set[str]:
        """Keep the fewest instances of old version `w` that hold its live requests; migrate the
        requests of the others into them, but only off instances that then become empty, only
        into free slots and free KV tokens, and only while the newest version needs the room."""
        mine = {k: i for k, i in self._by_version.get(w, {}).items() if i.held is None}
        empty = [k for k in self._empty.get(w, {}) if k in mine]
        migrate = self._spare(w) >= self._min_capacity and self._consolidating()
        if not migrate and not empty:
            return set(mine)  # nothing can move and nothing is idle: every instance stays
        order = sorted(mine.values(), key=lambda i: (not i.ready, -len(i.requests), i.id))
        kept: list[_Instance] = []
        room = room_tokens = 0
        need, need_tokens = self._live.get(w, 0), self._live_tokens.get(w, 0)
        for inst in order:
            # Slots and KV tokens count alike: kept instances must hold the version's live
            # requests by both, or an emptied one is released and asked for again.
            enough = room >= need and room_tokens >= need_tokens
            if enough and not inst.requests:
                continue
            if (
                migrate
                and enough
                and inst.ready
                and self._retargetable(inst)
                and self._consolidating()  # an instance freed already may be the room needed
                and self._move_all(inst, kept, actions)
            ):
                self._freed_slots += inst.capacity  # loads the newest version in this plan
                continue
            kept.append(inst)
            room += inst.capacity
            room_tokens += _UNLIMITED if inst.tokens is None else inst.tokens
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
        """Old version `w` has parked requests and no room for them: give it, in this one plan,
        as many instances as its parked requests need (packed as they would resume) beside the
        ones already loading it, so that no load completion asks for more. A multi-version
        instance with room loads `w` beside its versions first (nothing drains)."""
        if self._multi:
            if any(w in i.adding for i in self._multi.values()):
                return  # room to come
            head = self._requests[self._parked[w][0]].size
            roomy = [i for i in self._multi.values() if i.version is not None and i.fits(head)]
            if roomy:
                self._add_version(min(roomy, key=lambda i: (-i.free, i.order)), w, actions)
                return
        keep.update(self._loading.get(w, {}))  # room to come for `w`: not to be re-targeted
        targets = self._targets(w)
        queue = self._parked[w]
        held = self._held(w, targets)
        if held == len(queue):
            return
        spare = sorted(
            (
                i
                for i in self._instances.values()
                if i.id not in keep and not i.requests and not i.draining and i.held is None
            ),
            key=lambda i: (i.version == self._newest and i.ready, i.id),
        )
        for inst in spare:
            if not inst.fits(self._requests[queue[held]].size):
                continue
            if inst.version != w and not self._retargetable(inst):
                continue
            keep.add(inst.id)
            if inst.version != w:
                self._load(inst, w, actions)
            targets.append(inst)
            held = self._held(w, targets)
            if held == len(queue):
                return
        if self._draining:
            return  # one is already on its way
        size = self._requests[queue[held]].size
        newest = [
            i
            for i in self._instances.values()
            if i.id not in keep
            and i.requests
            and i.held is None
            and (i.tokens is None or i.tokens >= size)
        ]
        if newest:
            inst = min(newest, key=lambda i: (len(i.requests), i.id))
            self._set_draining(inst, True)
            actions.append(Drain(inst.id))

    def _oldest_waiting(self, *, default: int) -> int:
        """The oldest version whose parked requests still need an instance: no room, and not
        held by the instances loading it (a load for it would be re-targeted once they are in)."""
        waiting = [
            w for w, rs in self._parked.items() if rs and self._held(w, self._targets(w)) < len(rs)
        ]
        return min(waiting, default=default)

    def _resume_parked(self, actions: list[Action]) -> None:
        for w in sorted(self._parked):
            queue = self._parked[w]
            while queue:
                run_on = self._newest if self._mode in (Mode.PARTIAL, Mode.INFLIGHT) else w
                rid = queue[0]
                req = self._requests[rid]
                dst = self._room(run_on, req.size)
                if dst is None:
                    break
                queue.pop(0)
                if req.version != run_on:
                    self._count_live(req.version, -1, -req.size)
                    self._count_live(run_on, 1, req.size)
                    req.version = run_on
                self._attach(dst, rid)
                actions.append(Resume(rid, dst.id, run_on))
        self._parked = {w: q for w, q in self._parked.items() if q}

    def _consolidating(self) -> bool:
        """Whether freeing an old version's instance pays: no demand was ever reported, or more
        requests wait than the newest version's loading instances and those this plan freed take."""
        if self._demand is None:
            return True
        return self._demand > self._loading_slots.get(self._newest, 0) + self._freed_slots
