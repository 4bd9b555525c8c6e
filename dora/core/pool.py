"""The orchestrator's bookkeeping: instances, live requests and the indexes over them, kept in
step by a few helpers (`_index`/`_unindex`, `_attach`/`_detach`, `_load`, `_fail`), and the views
a driver reads. The placement rules live in `orchestrator.py`, on top of this class; they change
state only through these helpers, so the indexes never disagree with the instances.

Indexes, so that an event costs about O(log n) rather than a pass over the pool: instances by
version, their free slots in a lazy heap per version (entries that no longer describe their
instance are dropped when met), the empty, loading and draining ones in sets, slots and requests
per version, and the live requests and their KV tokens per version (no zero entries, so nothing
grows with the number of versions a run has had). A multi-version instance is indexed under the
newest version it holds; the others it holds are found by a pass over the multi-version instances
(`_holder`), which only a request of an older version needs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from dora.core.actions import Action, Fail, FailReason, InstanceView, Load, Mode, Park, Unload
from dora.errors import SchedulingError

__all__ = ["Pool"]

_UNLIMITED = 1 << 62  # the KV-token room of an instance without a token capacity


@dataclass(slots=True)
class _Instance:
    id: str
    capacity: int
    order: int  # join order: ties between equally free instances go to the older one
    tokens: int | None = None  # KV-cache capacity in tokens (None: not limited)
    version: int | None = None
    ready: bool = False
    draining: bool = False
    load_id: int = 0  # the pending `Load`'s id (0: none)
    told: int = -1  # the input epoch of its last `Load` (see `Pool._changed`)
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
class _Request:
    version: int
    instance: str | None  # None: parked
    size: int = 0  # context tokens, as last reported by the driver (`set_size`)
    failed: bool = False  # a `Fail` was emitted: parked, never resumed, until `finish`


class Pool:
    """The state the orchestrator's rules read and change (see the module docstring)."""

    def __init__(self, *, mode: Mode, newest: int) -> None:
        self._mode = mode
        self._newest = newest
        self._instances: dict[str, _Instance] = {}
        self._requests: dict[str, _Request] = {}
        self._live: dict[int, int] = {}  # version -> live requests (R_w); no zero entries
        self._live_tokens: dict[int, int] = {}  # version -> context tokens of its live requests
        self._parked: dict[int, list[str]] = {}  # version -> parked requests, in park order
        self._demand: int | None = None  # requests waiting for room (None: not reported)
        self._freed_slots = 0  # capacity the plan under way freed for the newest version
        self._joined = 0
        self._loads = 0  # `Load` ids handed out
        self._epoch = 0  # changes of the inputs so far: a load is told once per epoch
        self._deferred = False  # a plan left an instance alone as told in this epoch
        self._held_back = 0  # loads (or consolidations) left alone for that reason
        self._stale_loads = 0
        self._failures = dict.fromkeys(FailReason, 0)
        self._token_caps: dict[int | None, int] = {}  # instances per KV-token capacity
        self._min_capacity = 0
        # Indexes, so that an event costs about O(log n) rather than a pass over the pool:
        self._by_version: dict[int | None, dict[str, _Instance]] = {}
        self._empty: dict[int | None, dict[str, None]] = {}  # version -> instances with no request
        self._loading: dict[int, dict[str, None]] = {}  # version -> instances loading it
        self._loading_slots: dict[int, int] = {}  # version -> capacity of those instances
        self._slots: dict[int | None, int] = {}  # version -> capacity of its instances
        self._used: dict[int | None, int] = {}  # version -> requests on its instances
        self._draining: dict[str, None] = {}
        self._multi: dict[str, _Instance] = {}  # the multi-version instances
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
        return dict(sorted(self._live.items()))

    def loaded_versions(self) -> set[int]:
        """Versions held or being loaded by some instance: by a multi-version one, its newest
        (held or loading); the older ones it keeps serve only requests already on it."""
        if not self._multi:
            return {w for w, d in self._by_version.items() if d and w is not None}
        out = {
            w
            for w, d in self._by_version.items()
            if w is not None and any(i.held is None for i in d.values())
        }
        for inst in self._multi.values():
            newest = max(
                (*inst.adding, *(() if inst.version is None else (inst.version,))), default=None
            )
            if newest is not None:
                out.add(newest)
        return out

    def pending_load(self, instance_id: str) -> Load | None:
        """The `Load` the instance waits for (the one `on_loaded` accepts), or None: it is
        ready, or unknown."""
        inst = self._instances.get(instance_id)
        if inst is None or not inst.load_id or inst.version is None:
            return None
        return Load(inst.id, inst.version, inst.load_id)

    def is_pending(self, load: Load) -> bool:
        """Whether `load` is one that `on_loaded` would accept (not superseded, not a ghost's)."""
        inst = self._instances.get(load.instance)
        if inst is None:
            return False
        if inst.held is not None:
            return inst.adding.get(load.version) == load.id
        return self.pending_load(inst.id) == load

    def held_versions(self, instance_id: str) -> frozenset[int]:
        """The versions the instance serves now: those it holds as adapters (multi-version), or
        its one version once loaded."""
        inst = self._instances[instance_id]
        if inst.held is not None:
            return frozenset(inst.held)
        return frozenset(() if inst.version is None or not inst.ready else (inst.version,))

    def failures(self) -> dict[FailReason, int]:
        """Requests failed (`Fail`), per reason."""
        return {r: n for r, n in self._failures.items() if n}

    @property
    def stale_loads(self) -> int:
        """Completions `on_loaded` ignored: not the pending load of a live instance."""
        return self._stale_loads

    @property
    def held_back_loads(self) -> int:
        """Loads (and consolidations, which end in one) a plan left for the next change of the
        inputs because the instance was told to load since the last one. The rules plan a
        parked version's whole need at once, so this stays 0 unless they missed a case; it is
        a backstop against load ping-pong, not a part of the plan."""
        return self._held_back

    def is_live(self, request: str) -> bool:
        return request in self._requests

    def location(self, request: str) -> str | None:
        """The instance running `request`, or None while it is parked."""
        return self._req(request).instance

    def request_version(self, request: str) -> int:
        return self._req(request).version

    # --- helpers -----------------------------------------------------------------------------

    def _req(self, request: str) -> _Request:
        req = self._requests.get(request)
        if req is None:
            raise SchedulingError(f"unknown request {request!r}")
        return req

    def _too_long(self, size: int) -> bool:
        """Longer than every instance's KV-token capacity (never while an instance has none,
        nor while the pool is empty: instances may still come)."""
        caps = self._token_caps
        return bool(caps) and None not in caps and size > max(c for c in caps if c is not None)

    def _fail_parked_too_long(self, actions: list[Action]) -> None:
        for rid in [r for q in self._parked.values() for r in q]:
            if self._too_long(self._requests[rid].size):
                self._fail(rid, FailReason.TOO_LONG, actions)

    def _fail(self, rid: str, reason: FailReason, actions: list[Action]) -> None:
        req = self._requests[rid]
        if req.instance is None:
            self._parked[req.version].remove(rid)
        else:
            actions.append(Park(rid, req.instance))
            self._detach(self._instances[req.instance], rid)
            req.instance = None
        req.failed = True
        self._failures[reason] += 1
        actions.append(Fail(rid, reason))

    def _count_live(self, version: int, requests: int, tokens: int) -> None:
        n = self._live.get(version, 0) + requests
        if n:
            self._live[version] = n
            self._live_tokens[version] = self._live_tokens.get(version, 0) + tokens
        else:
            self._live.pop(version, None)
            self._live_tokens.pop(version, None)

    def _park(self, rid: str) -> None:
        req = self._requests[rid]
        req.instance = None
        self._parked.setdefault(req.version, []).append(rid)

    def _spare(self, version: int) -> int:
        """Free slots on the instances of `version`."""
        return self._slots.get(version, 0) - self._used.get(version, 0)

    def _idle_not_newest(self) -> list[_Instance]:
        """Empty single-version instances that hold (or load) another version than the newest,
        in join order."""
        idle = [
            inst
            for v, ids in self._empty.items()
            if v != self._newest
            for i in ids
            if (inst := self._instances[i]).held is None
        ]
        return sorted(idle, key=lambda i: i.order)

    def _room(self, version: int, size: int = 0) -> _Instance | None:
        """The ready instance of `version` with the most free slots that fits a request of `size`
        context tokens (draining ones included: they still run their own version), else a
        multi-version instance that holds `version` among others."""
        best = self._most_free(version, accepting=False)
        if best is not None and best.fits(size):
            return best
        fit = [i for i in self._by_version.get(version, {}).values() if i.ready and i.fits(size)]
        best = min(fit, key=lambda i: (-i.free, i.order), default=None)
        return best if best is not None else self._holder(version, 1, size)

    def _holder(self, version: int, n: int, size: int) -> _Instance | None:
        """The multi-version instance holding `version` with the most free slots, if it has `n`
        of them and the KV tokens for a request of `size` (slots and tokens are shared by all
        the versions it holds)."""
        fit = [
            i
            for i in self._multi.values()
            if i.held is not None and version in i.held and i.free >= n and i.fits(size)
        ]
        return min(fit, key=lambda i: (-i.free, i.order), default=None)

    def _add_version(self, inst: _Instance, version: int, actions: list[Action]) -> None:
        """Load `version` onto multi-version `inst` beside what it holds: its requests keep
        running, nothing drains."""
        self._loads += 1
        inst.adding[version] = self._loads
        actions.append(Load(inst.id, version, self._loads))

    def _drop_unused(self, inst: _Instance, actions: list[Action]) -> None:
        """Unload the versions of multi-version `inst` that no live request needs anywhere (a
        request of the version elsewhere may still move here: its instance may die), except the
        newest, the instance's own newest one, and version 0, the base model itself."""
        assert inst.held is not None
        for w in sorted(inst.held):
            if w not in (0, self._newest, inst.version) and w not in self._live:
                inst.held.discard(w)
                actions.append(Unload(inst.id, w))

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

    def _changed(self) -> None:
        """An input changed (an instance, a request, the newest version, the demand): from now
        on every instance may be told to load again."""
        self._epoch += 1

    def _retargetable(self, inst: _Instance) -> bool:
        """Whether a plan may tell `inst` to load: not already told since the inputs last
        changed. A plan that leaves one alone for this reason marks itself deferred, so that
        the next change of the inputs plans again."""
        if inst.told != self._epoch:
            return True
        self._deferred = True
        self._held_back += 1
        return False

    def _load(self, inst: _Instance, version: int, actions: list[Action]) -> None:
        if inst.requests:
            raise SchedulingError(f"cannot load {inst.id!r}: it holds requests")
        if inst.told == self._epoch:
            raise SchedulingError(f"{inst.id!r} was told to load since the inputs last changed")
        self._unindex(inst)
        self._loads += 1
        inst.version, inst.ready, inst.load_id = version, False, self._loads
        inst.told = self._epoch
        self._index(inst)
        actions.append(Load(inst.id, version, self._loads))

    def _swap(self, inst: _Instance, version: int, actions: list[Action]) -> None:
        """Load `version` onto `inst` under its running requests (mode inflight): they stay, and
        their leases move to `version`, the one that samples their next tokens."""
        rids = sorted(inst.requests)
        for rid in rids:
            self._detach(inst, rid)
        self._load(inst, version, actions)
        for rid in rids:
            req = self._requests[rid]
            self._count_live(req.version, -1, -req.size)
            self._count_live(version, 1, req.size)
            req.version = version
            self._attach(inst, rid)

    def _forget_ghost_versions(self, newest: int, actions: list[Action]) -> None:
        """A roll-back to `newest`: multi-version instances unload the versions past it (the
        ghosts) and forget their loads; one that held only ghosts holds nothing, unready."""
        for inst in self._multi.values():
            assert inst.held is not None
            inst.adding = {w: n for w, n in inst.adding.items() if w <= newest}
            for ghost in sorted(w for w in inst.held if w > newest):
                inst.held.discard(ghost)
                actions.append(Unload(inst.id, ghost))
            if inst.version is not None and inst.version > newest:
                self._unindex(inst)
                inst.version = max(inst.held, default=None)
                inst.ready = inst.version is not None
                self._index(inst)

    def _added(self, inst: _Instance, load: Load) -> bool:
        """`load` onto multi-version `inst` finished: it holds one more version and serves it at
        once (indexed under it when it is its newest). False (counted stale) if superseded."""
        assert inst.held is not None
        if inst.adding.get(load.version) != load.id:
            self._stale_loads += 1
            return False
        del inst.adding[load.version]
        inst.held.add(load.version)
        if inst.version is None or load.version > inst.version:
            self._unindex(inst)
            inst.version, inst.ready = load.version, True
            self._index(inst)
        return True

    def _targets(self, w: int) -> list[_Instance]:
        """Where `w`'s parked requests can go: its instances with a free slot, loading or not
        (a loading instance holds no request)."""
        return [i for i in self._by_version.get(w, {}).values() if i.free > 0]

    def _held(self, w: int, targets: list[_Instance]) -> int:
        """How many of `w`'s parked requests, from the head, `targets` would hold were they all
        ready: packed in park order, each onto the one with the most free slots that has its
        KV tokens (the oldest on ties), as `_resume_parked` does, until one fits none."""
        free = [i.free for i in targets]
        used = [i.used_tokens for i in targets]
        held = 0
        for rid in self._parked[w]:
            size = self._requests[rid].size
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
