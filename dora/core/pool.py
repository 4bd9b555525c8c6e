"""The orchestrator's state: instances, live requests and the indexes over them, kept in step by
a few helpers (`index`/`unindex`, `attach`/`detach`, `load`, `swap`, `fail`). The rules that
decide where each version runs are functions over this state (`planning.py`); the orchestrator
(`orchestrator.py`) takes the driver's events and answers its queries. Both change the state only
through these helpers, so the indexes never disagree with the instances.

Indexes, so that an event costs about O(log n) rather than a pass over the pool: instances by
version, their free slots in a lazy heap per version (entries that no longer describe their
instance are dropped when met), the empty, loading and draining ones in sets, slots and requests
per version, and the live requests and their KV tokens per version (no zero entries, so nothing
grows with the number of versions a run has had). A multi-version instance is indexed under the
newest version it holds; the others it holds are found by a pass over the multi-version instances
(`holder`), which only a request of an older version needs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from dora.core.actions import Action, Fail, FailReason, Load, Mode, Park, Unload
from dora.errors import SchedulingError

__all__ = ["Pool"]

UNLIMITED = 1 << 62  # the KV-token room of an instance without a token capacity


@dataclass(slots=True)
class PoolInstance:
    id: str
    capacity: int
    order: int  # join order: ties between equally free instances go to the older one
    tokens: int | None = None  # KV-cache capacity in tokens (None: not limited)
    version: int | None = None
    ready: bool = False
    draining: bool = False
    load_id: int = 0  # the pending `Load`'s id (0: none)
    told: int = -1  # the input epoch of its last `Load` (see `Pool.changed`)
    requests: set[str] = field(default_factory=set)
    used_tokens: int = 0
    # Multi-version (adapter-capable) instances only: the versions loaded, and the loads under
    # way (version -> `Load` id). `version` is then the newest one held (None: none yet); the
    # instance is indexed under it, and serves every version in `held` from shared slots.
    held: set[int] | None = None
    adding: dict[int, int] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return self.capacity - len(self.requests)

    def fits(self, size: int) -> bool:
        """Room for one more request of `size` context tokens."""
        return self.free > 0 and (self.tokens is None or self.used_tokens + size <= self.tokens)


@dataclass(slots=True)
class PoolRequest:
    version: int
    instance: str | None  # None: parked
    size: int = 0  # context tokens, as last reported by the driver (`set_size`)
    failed: bool = False  # a `Fail` was emitted: parked, never resumed, until `finish`


class Pool:
    """The state the orchestrator's rules read and change (see the module docstring)."""

    def __init__(self, *, mode: Mode, newest: int) -> None:
        self.mode = mode
        self.newest = newest
        self.instances: dict[str, PoolInstance] = {}
        self.requests: dict[str, PoolRequest] = {}
        self.live: dict[int, int] = {}  # version -> live requests (R_w); no zero entries
        self.live_tokens: dict[int, int] = {}  # version -> context tokens of its live requests
        self.parked: dict[int, list[str]] = {}  # version -> parked requests, in park order
        self.demand: int | None = None  # requests waiting for room (None: not reported)
        self.freed_slots = 0  # capacity the plan under way freed for the newest version
        self.joined = 0
        self.loads = 0  # `Load` ids handed out
        self.epoch = 0  # changes of the inputs so far: a load is told once per epoch
        self.deferred = False  # a plan left an instance alone as told in this epoch
        self.held_back = 0  # loads (or consolidations) left alone for that reason
        self.stale_loads = 0
        self.failures = dict.fromkeys(FailReason, 0)
        self.token_caps: dict[int | None, int] = {}  # instances per KV-token capacity
        self.min_capacity = 0
        # Indexes, so that an event costs about O(log n) rather than a pass over the pool:
        self.by_version: dict[int | None, dict[str, PoolInstance]] = {}
        self.empty: dict[int | None, dict[str, None]] = {}  # version -> instances with no request
        self.loading: dict[int, dict[str, None]] = {}  # version -> instances loading it
        self.loading_slots: dict[int, int] = {}  # version -> capacity of those instances
        self.slots: dict[int | None, int] = {}  # version -> capacity of its instances
        self.used: dict[int | None, int] = {}  # version -> requests on its instances
        self.draining: dict[str, None] = {}
        self.multi: dict[str, PoolInstance] = {}  # the multi-version instances
        self._heaps: dict[int, list[tuple[int, int, str]]] = {}  # (-free, order, id), lazy

    # --- helpers -----------------------------------------------------------------------------

    def req(self, request: str) -> PoolRequest:
        req = self.requests.get(request)
        if req is None:
            raise SchedulingError(f"unknown request {request!r}")
        return req

    def too_long(self, size: int) -> bool:
        """Longer than every instance's KV-token capacity (never while an instance has none,
        nor while the pool is empty: instances may still come)."""
        caps = self.token_caps
        return bool(caps) and None not in caps and size > max(c for c in caps if c is not None)

    def fail_parked_too_long(self, actions: list[Action]) -> None:
        for rid in [r for q in self.parked.values() for r in q]:
            if self.too_long(self.requests[rid].size):
                self.fail(rid, FailReason.TOO_LONG, actions)

    def fail(self, rid: str, reason: FailReason, actions: list[Action]) -> None:
        req = self.requests[rid]
        if req.instance is None:
            self.parked[req.version].remove(rid)
        else:
            actions.append(Park(rid, req.instance))
            self.detach(self.instances[req.instance], rid)
            req.instance = None
        req.failed = True
        self.failures[reason] += 1
        actions.append(Fail(rid, reason))

    def count_live(self, version: int, requests: int, tokens: int) -> None:
        n = self.live.get(version, 0) + requests
        if n:
            self.live[version] = n
            self.live_tokens[version] = self.live_tokens.get(version, 0) + tokens
        else:
            self.live.pop(version, None)
            self.live_tokens.pop(version, None)

    def park(self, rid: str) -> None:
        req = self.requests[rid]
        req.instance = None
        self.parked.setdefault(req.version, []).append(rid)

    def spare(self, version: int) -> int:
        """Free slots on the instances of `version`."""
        return self.slots.get(version, 0) - self.used.get(version, 0)

    def idle_not_newest(self) -> list[PoolInstance]:
        """Empty single-version instances that hold (or load) another version than the newest,
        in join order."""
        idle = [
            inst
            for v, ids in self.empty.items()
            if v != self.newest
            for i in ids
            if (inst := self.instances[i]).held is None
        ]
        return sorted(idle, key=lambda i: i.order)

    def room(self, version: int, size: int = 0) -> PoolInstance | None:
        """The ready instance of `version` with the most free slots that fits a request of `size`
        context tokens (draining ones included: they still run their own version), else a
        multi-version instance that holds `version` among others."""
        best = self.most_free(version, accepting=False)
        if best is not None and best.fits(size):
            return best
        fit = [i for i in self.by_version.get(version, {}).values() if i.ready and i.fits(size)]
        best = min(fit, key=lambda i: (-i.free, i.order), default=None)
        return best if best is not None else self.holder(version, 1, size)

    def holder(self, version: int, n: int, size: int) -> PoolInstance | None:
        """The multi-version instance holding `version` with the most free slots, if it has `n`
        of them and the KV tokens for a request of `size` (slots and tokens are shared by all
        the versions it holds)."""
        fit = [
            i
            for i in self.multi.values()
            if i.held is not None and version in i.held and i.free >= n and i.fits(size)
        ]
        return min(fit, key=lambda i: (-i.free, i.order), default=None)

    def add_version(self, inst: PoolInstance, version: int, actions: list[Action]) -> None:
        """Load `version` onto multi-version `inst` beside what it holds: its requests keep
        running, nothing drains."""
        self.loads += 1
        inst.adding[version] = self.loads
        actions.append(Load(inst.id, version, self.loads))

    def drop_unused(self, inst: PoolInstance, actions: list[Action]) -> None:
        """Unload the versions of multi-version `inst` that no live request needs anywhere (a
        request of the version elsewhere may still move here: its instance may die), except the
        newest, the instance's own newest one, and version 0, the base model itself."""
        assert inst.held is not None
        for w in sorted(inst.held):
            if w not in (0, self.newest, inst.version) and w not in self.live:
                inst.held.discard(w)
                actions.append(Unload(inst.id, w))

    def most_free(self, version: int, *, accepting: bool) -> PoolInstance | None:
        """The ready instance of `version` with the most free slots (the oldest on ties), from a
        lazy heap: entries that no longer describe their instance are dropped when met."""
        heap = self._heaps.get(version)
        if not heap:
            return None
        skipped: list[tuple[int, int, str]] = []
        best = None
        while heap:
            neg, order, iid = heap[0]
            inst = self.instances.get(iid)
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

    def _push(self, inst: PoolInstance) -> None:
        if inst.version is None or not inst.ready:
            return
        heap = self._heaps.setdefault(inst.version, [])
        heapq.heappush(heap, (-inst.free, inst.order, inst.id))
        if len(heap) > 4 * len(self.by_version.get(inst.version, {})) + 64:
            live = self.by_version.get(inst.version, {}).values()
            heap[:] = [(-i.free, i.order, i.id) for i in live if i.ready]
            heapq.heapify(heap)

    def index(self, inst: PoolInstance) -> None:
        v = inst.version
        self.by_version.setdefault(v, {})[inst.id] = inst
        self.slots[v] = self.slots.get(v, 0) + inst.capacity
        self.used[v] = self.used.get(v, 0) + len(inst.requests)
        if not inst.requests:
            self.empty.setdefault(v, {})[inst.id] = None
        if v is not None and not inst.ready:
            self.loading.setdefault(v, {})[inst.id] = None
            self.loading_slots[v] = self.loading_slots.get(v, 0) + inst.capacity
        self._push(inst)

    def unindex(self, inst: PoolInstance) -> None:
        v = inst.version
        del self.by_version[v][inst.id]
        self.slots[v] -= inst.capacity
        self.used[v] -= len(inst.requests)
        if not self.by_version[v]:
            del self.by_version[v]
        empty = self.empty.get(v)
        if empty is not None:
            empty.pop(inst.id, None)
            if not empty:
                del self.empty[v]
        loading = None if v is None else self.loading.get(v)
        if v is not None and loading is not None and inst.id in loading:
            del loading[inst.id]
            self.loading_slots[v] -= inst.capacity
            if not loading:
                del self.loading[v]

    def attach(self, inst: PoolInstance, rid: str) -> None:
        req = self.requests[rid]
        if not inst.requests:
            empty = self.empty[inst.version]
            del empty[inst.id]
            if not empty:
                del self.empty[inst.version]
        inst.requests.add(rid)
        inst.used_tokens += req.size
        req.instance = inst.id
        self.used[inst.version] += 1
        self._push(inst)

    def detach(self, inst: PoolInstance, rid: str) -> None:
        inst.requests.discard(rid)
        inst.used_tokens -= self.requests[rid].size
        self.used[inst.version] -= 1
        if not inst.requests:
            self.empty.setdefault(inst.version, {})[inst.id] = None
        self._push(inst)

    def set_draining(self, inst: PoolInstance, draining: bool) -> None:
        inst.draining = draining
        if draining:
            self.draining[inst.id] = None
        else:
            self.draining.pop(inst.id, None)

    def changed(self) -> None:
        """An input changed (an instance, a request, the newest version, the demand): from now
        on every instance may be told to load again."""
        self.epoch += 1

    def retargetable(self, inst: PoolInstance) -> bool:
        """Whether a plan may tell `inst` to load: not already told since the inputs last
        changed. A plan that leaves one alone for this reason marks itself deferred, so that
        the next change of the inputs plans again."""
        if inst.told != self.epoch:
            return True
        self.deferred = True
        self.held_back += 1
        return False

    def load(self, inst: PoolInstance, version: int, actions: list[Action]) -> None:
        if inst.requests:
            raise SchedulingError(f"cannot load {inst.id!r}: it holds requests")
        if inst.told == self.epoch:
            raise SchedulingError(f"{inst.id!r} was told to load since the inputs last changed")
        self.unindex(inst)
        self.loads += 1
        inst.version, inst.ready, inst.load_id = version, False, self.loads
        inst.told = self.epoch
        self.index(inst)
        actions.append(Load(inst.id, version, self.loads))

    def swap(self, inst: PoolInstance, version: int, actions: list[Action]) -> None:
        """Load `version` onto `inst` under its running requests (mode inflight): they stay, and
        their leases move to `version`, the one that samples their next tokens."""
        rids = sorted(inst.requests)
        for rid in rids:
            self.detach(inst, rid)
        self.load(inst, version, actions)
        for rid in rids:
            req = self.requests[rid]
            self.count_live(req.version, -1, -req.size)
            self.count_live(version, 1, req.size)
            req.version = version
            self.attach(inst, rid)

    def forget_ghost_versions(self, newest: int, actions: list[Action]) -> None:
        """A roll-back to `newest`: multi-version instances unload the versions past it (the
        ghosts) and forget their loads; one that held only ghosts holds nothing, unready."""
        for inst in self.multi.values():
            assert inst.held is not None
            inst.adding = {w: n for w, n in inst.adding.items() if w <= newest}
            for ghost in sorted(w for w in inst.held if w > newest):
                inst.held.discard(ghost)
                actions.append(Unload(inst.id, ghost))
            if inst.version is not None and inst.version > newest:
                self.unindex(inst)
                inst.version = max(inst.held, default=None)
                inst.ready = inst.version is not None
                self.index(inst)

    def added(self, inst: PoolInstance, load: Load) -> bool:
        """`load` onto multi-version `inst` finished: it holds one more version and serves it at
        once (indexed under it when it is its newest). False (counted stale) if superseded."""
        assert inst.held is not None
        if inst.adding.get(load.version) != load.id:
            self.stale_loads += 1
            return False
        del inst.adding[load.version]
        inst.held.add(load.version)
        if inst.version is None or load.version > inst.version:
            self.unindex(inst)
            inst.version, inst.ready = load.version, True
            self.index(inst)
        return True

    def targets(self, w: int) -> list[PoolInstance]:
        """Where `w`'s parked requests can go: its instances with a free slot, loading or not
        (a loading instance holds no request)."""
        return [i for i in self.by_version.get(w, {}).values() if i.free > 0]

    def parked_fit(self, w: int, targets: list[PoolInstance]) -> int:
        """How many of `w`'s parked requests, from the head, `targets` would hold were they all
        ready: packed in park order, each onto the one with the most free slots that has its
        KV tokens (the oldest on ties), as `planning.resume_parked` does, until one fits none."""
        free = [i.free for i in targets]
        used = [i.used_tokens for i in targets]
        held = 0
        for rid in self.parked[w]:
            size = self.requests[rid].size
            fit = [
                k
                for k, inst in enumerate(targets)
                if free[k] > 0 and (inst.tokens is None or used[k] + size <= inst.tokens)
            ]
            if not fit:
                break
            best = min(fit, key=lambda k: (-free[k], targets[k].order))
            free[best] -= 1
            used[best] += size
            held += 1
        return held
