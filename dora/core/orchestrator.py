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
`pool.py`, the rules below are functions over it in `planning.py`, and this module takes the
events and answers the queries.

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
- Planning is incremental (the pool's indexes): `place` is O(log n), a finishing request O(1)
  unless it frees a whole old instance, a publish O(m log m) over the old versions' `m`
  instances; a full pass only while requests are parked or an instance drains (rare).
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
from dora.core.planning import consolidating, plan
from dora.core.pool import Pool, PoolInstance, PoolRequest
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


class Orchestrator:
    """Versions -> instances. See the module docstring for the rules."""

    def __init__(self, *, mode: Mode = Mode.DORA, newest: int = 0) -> None:
        self.pool = Pool(mode=mode, newest=newest)
        """The state the rules read and change (`pool.py`)."""

    # --- views -------------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self.pool.mode

    @property
    def newest(self) -> int:
        return self.pool.newest

    @property
    def demand(self) -> int | None:
        return self.pool.demand

    def instances(self) -> list[InstanceView]:
        return [
            InstanceView(i.id, i.capacity, i.version, i.ready, i.draining, len(i.requests))
            for i in self.pool.instances.values()
        ]

    def accepts(self, instance_id: str) -> bool:
        """Whether `place` may start groups on the instance: ready and not draining."""
        inst = self.pool.instances.get(instance_id)
        return inst is not None and inst.ready and not inst.draining

    def live(self) -> dict[int, int]:
        """`R_w`: live requests per version (placed or parked)."""
        return dict(sorted(self.pool.live.items()))

    def loaded_versions(self) -> set[int]:
        """Versions held or being loaded by some instance: by a multi-version one, its newest
        (held or loading); the older ones it keeps serve only requests already on it."""
        if not self.pool.multi:
            return {w for w, d in self.pool.by_version.items() if d and w is not None}
        out = {
            w
            for w, d in self.pool.by_version.items()
            if w is not None and any(i.held is None for i in d.values())
        }
        for inst in self.pool.multi.values():
            newest = max(
                (*inst.adding, *(() if inst.version is None else (inst.version,))), default=None
            )
            if newest is not None:
                out.add(newest)
        return out

    def pending_load(self, instance_id: str) -> Load | None:
        """The `Load` the instance waits for (the one `on_loaded` accepts), or None: it is
        ready, or unknown."""
        inst = self.pool.instances.get(instance_id)
        if inst is None or not inst.load_id or inst.version is None:
            return None
        return Load(inst.id, inst.version, inst.load_id)

    def is_pending(self, load: Load) -> bool:
        """Whether `load` is one that `on_loaded` would accept (not superseded, not a ghost's)."""
        inst = self.pool.instances.get(load.instance)
        if inst is None:
            return False
        if inst.held is not None:
            return inst.adding.get(load.version) == load.id
        return self.pending_load(inst.id) == load

    def held_versions(self, instance_id: str) -> frozenset[int]:
        """The versions the instance serves now: those it holds as adapters (multi-version), or
        its one version once loaded."""
        inst = self.pool.instances[instance_id]
        if inst.held is not None:
            return frozenset(inst.held)
        return frozenset(() if inst.version is None or not inst.ready else (inst.version,))

    def failures(self) -> dict[FailReason, int]:
        """Requests failed (`Fail`), per reason."""
        return {r: n for r, n in self.pool.failures.items() if n}

    @property
    def stale_loads(self) -> int:
        """Completions `on_loaded` ignored: not the pending load of a live instance."""
        return self.pool.stale_loads

    @property
    def held_back_loads(self) -> int:
        """Loads (and consolidations, which end in one) a plan left for the next change of the
        inputs because the instance was told to load since the last one. The rules plan a
        parked version's whole need at once, so this stays 0 unless they missed a case; it is
        a backstop against load ping-pong, not a part of the plan."""
        return self.pool.held_back

    def is_live(self, request: str) -> bool:
        return request in self.pool.requests

    def location(self, request: str) -> str | None:
        """The instance running `request`, or None while it is parked."""
        return self.pool.req(request).instance

    def request_version(self, request: str) -> int:
        return self.pool.req(request).version

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
        if instance_id in self.pool.instances:
            raise SchedulingError(f"instance {instance_id!r} already exists")
        if capacity < 1:
            raise SchedulingError(f"instance capacity must be >= 1, got {capacity}")
        if tokens is not None and tokens < 1:
            raise SchedulingError(f"instance token capacity must be >= 1, got {tokens}")
        self.pool.changed()
        self.pool.joined += 1
        inst = PoolInstance(instance_id, capacity, self.pool.joined, tokens)
        if multi_version and self.pool.mode in (Mode.DORA, Mode.SYNC):
            inst.held = set()
            self.pool.multi[instance_id] = inst
        self.pool.instances[instance_id] = inst
        self.pool.min_capacity = min(self.pool.min_capacity or capacity, capacity)
        self.pool.token_caps[tokens] = self.pool.token_caps.get(tokens, 0) + 1
        self.pool.index(inst)
        actions: list[Action] = []
        self.pool.fail_parked_too_long(actions)  # into an empty pool: its first capacity counts
        return actions + plan(self.pool)

    def remove_instance(self, instance_id: str) -> list[Action]:
        """The instance died (or was taken away): its requests continue elsewhere."""
        inst = self.pool.instances.get(instance_id)
        if inst is None:
            raise SchedulingError(f"unknown instance {instance_id!r}")
        self.pool.changed()
        self.pool.unindex(inst)
        del self.pool.instances[instance_id]
        self.pool.multi.pop(instance_id, None)
        self.pool.token_caps[inst.tokens] -= 1
        if not self.pool.token_caps[inst.tokens]:
            del self.pool.token_caps[inst.tokens]
        self.pool.set_draining(inst, False)
        actions: list[Action] = []
        for rid in sorted(inst.requests):
            req = self.pool.requests[rid]
            dst = self.pool.room(req.version, req.size)
            if dst is None:
                req.instance = None
                self.pool.parked.setdefault(req.version, []).append(rid)
                actions.append(Park(rid, instance_id))
            else:
                self.pool.attach(dst, rid)
                actions.append(Migrate(rid, instance_id, dst.id))
        self.pool.fail_parked_too_long(actions)  # the largest KV cache may have gone with it
        return actions + plan(self.pool)

    def on_loaded(self, load: Load) -> list[Action]:
        """`load` finished. Ignored (and counted in `stale_loads`) unless it is the instance's
        pending load (`pending_load`): the instance died, or got another `Load` since."""
        inst = self.pool.instances.get(load.instance)
        if inst is not None and inst.held is not None:
            return self._on_added(inst, load)
        if inst is None or inst.ready or inst.load_id != load.id or inst.version != load.version:
            self.pool.stale_loads += 1
            return []
        self.pool.unindex(inst)
        inst.ready = True
        inst.load_id = 0
        self.pool.index(inst)
        if load.version == self.pool.newest and not self.pool.parked and not self.pool.draining:
            return []  # a ready instance of the newest version changes no other decision
        return plan(self.pool)

    def _on_added(self, inst: PoolInstance, load: Load) -> list[Action]:
        """A load onto multi-version `inst` finished: it holds one more version (and serves it at
        once); versions no request needs any more are unloaded."""
        if not self.pool.added(inst, load):
            return []
        actions: list[Action] = []
        self.pool.drop_unused(inst, actions)
        return actions + plan(self.pool)

    def publish(self, version: int) -> list[Action]:
        """Version `version` is published and becomes the newest."""
        if version <= self.pool.newest:
            raise SchedulingError(f"version {version} is not newer than {self.pool.newest}")
        self.pool.changed()
        self.pool.newest = version
        actions: list[Action] = []
        if self.pool.mode is Mode.ONE_STEP_OFF:
            if self.pool.live:
                for inst in self.pool.instances.values():
                    if inst.version is not None and not inst.draining:
                        self.pool.set_draining(inst, True)
                        actions.append(Drain(inst.id))
        elif self.pool.mode is Mode.PARTIAL:
            for inst in self.pool.instances.values():
                for rid in sorted(inst.requests):
                    actions.append(Park(rid, inst.id))
                    self.pool.detach(inst, rid)
                    self.pool.park(rid)
        elif self.pool.mode is Mode.INFLIGHT:
            for inst in [i for i in self.pool.instances.values() if i.version is not None]:
                self.pool.swap(inst, version, actions)
        return actions + plan(self.pool)

    def set_demand(self, requests: int) -> list[Action]:
        """The driver's admission backlog: `requests` samples of admissible groups wait because no
        instance has room for them (0: none wait). Once reported, an old version is consolidated
        (its requests migrated to free a whole instance for the newest version) only while this
        exceeds the room that the newest version's loading instances will bring; a driver that
        never reports it gets consolidation whenever it frees an instance."""
        if requests < 0:
            raise SchedulingError(f"demand must be >= 0, got {requests}")
        if requests == self.pool.demand:
            return []
        self.pool.changed()
        before = consolidating(self.pool)
        self.pool.demand = requests
        if consolidating(self.pool) and not before:
            return plan(self.pool)
        return []

    def set_size(self, request: str, tokens: int) -> list[Action]:
        """The request's context is now `tokens` long (what it holds of an instance's KV cache).
        Reported by the driver when it knows it; used only against instances' token capacity.
        A request longer than every instance's capacity fails (`Fail`, `FailReason.TOO_LONG`)."""
        if tokens < 0:
            raise SchedulingError(f"request {request!r}: size must be >= 0 tokens, got {tokens}")
        req = self.pool.req(request)
        if tokens != req.size:
            self.pool.changed()
        if req.instance is not None:
            self.pool.instances[req.instance].used_tokens += tokens - req.size
        self.pool.count_live(req.version, 0, tokens - req.size)
        req.size = tokens
        if req.failed or not self.pool.too_long(tokens):
            return []
        actions: list[Action] = []
        self.pool.fail(request, FailReason.TOO_LONG, actions)
        return actions + plan(self.pool)

    def can_place(self, n: int, *, version: int) -> str | None:
        """The instance `place` would choose for `n` requests of `version`, or None. No change."""
        best = self.pool.most_free(version, accepting=True)
        if best is None or best.free < n:
            best = self.pool.holder(version, n, 0) if self.pool.multi else None
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
        self.pool.changed()
        best = self.pool.instances[where]
        for rid in requests:
            if rid in self.pool.requests:
                raise SchedulingError(f"request {rid!r} is already live")
            self.pool.requests[rid] = PoolRequest(version, None)
            self.pool.attach(best, rid)
        self.pool.count_live(version, len(requests), 0)
        return best.id

    def finish(self, request: str) -> list[Action]:
        """The request's lease ended (episode done, failed for good, or aborted)."""
        req = self.pool.requests.get(request)
        if req is None:
            raise SchedulingError(f"unknown request {request!r}")
        self.pool.changed()
        inst = None if req.instance is None else self.pool.instances[req.instance]
        if inst is None:
            if not req.failed:
                self.pool.parked[req.version].remove(request)
        else:
            self.pool.detach(inst, request)
        del self.pool.requests[request]
        self.pool.count_live(req.version, -1, -req.size)
        actions: list[Action] = []
        if (
            req.version not in self.pool.live
        ):  # its version's last lease: no adapter of it is needed
            for holder in self.pool.multi.values():
                if holder.held is not None and req.version in holder.held:
                    self.pool.drop_unused(holder, actions)
        if (
            inst is None
            or self.pool.parked
            or self.pool.draining
            or self.pool.deferred
            or self.pool.mode not in (Mode.DORA, Mode.SYNC)
        ):
            return actions + plan(self.pool)  # a parked request's end may leave a load unneeded
        if req.version == self.pool.newest or inst.held is not None:
            return actions
        # An old version's request ended and nothing waits: only its own version can change.
        if not inst.requests:
            # Nothing is parked, so the version's other requests sit on other instances: this
            # one is surplus (the rule's "fewest instances" never keeps an empty one).
            self.pool.load(inst, self.pool.newest, actions)
            return actions
        if self.pool.spare(req.version) >= self.pool.min_capacity and consolidating(self.pool):
            return actions + plan(self.pool)
        return actions

    def rebalance(self) -> list[Action]:
        """The periodic / KV-pressure trigger: apply the rules again."""
        return plan(self.pool)

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
        self.pool.changed()
        self.pool.newest = newest
        for rid, req in list(self.pool.requests.items()):
            if req.version > newest or rid in drop:
                if req.instance is not None:
                    self.pool.detach(self.pool.instances[req.instance], rid)
                del self.pool.requests[rid]
                self.pool.count_live(req.version, -1, -req.size)
        self.pool.parked = {
            w: kept
            for w, q in self.pool.parked.items()
            if (kept := [r for r in q if r in self.pool.requests])
        }
        actions: list[Action] = []
        self.pool.forget_ghost_versions(newest, actions)
        for inst in list(self.pool.instances.values()):
            if inst.version is not None and inst.version > newest:
                self.pool.unindex(inst)
                inst.version, inst.ready, inst.load_id = None, False, 0
                self.pool.index(inst)
                self.pool.set_draining(inst, False)
        return actions + plan(self.pool)
