"""A hypothesis state machine over the orchestrator alone, as a driver would drive it: instances
with KV-token limits join (some loaded at once) and die (mostly ones holding old versions'
requests), loads complete late and out of order (superseded ones too), groups start at the
newest version, requests grow and end (half the time to within a few tokens of their
instance's token limit), versions are published and rolled back; some instances are
multi-version (they hold versions as adapters). After every step: C1 for every placement
(`place`, `Migrate`, `Resume` only onto an instance that holds the request's own version, and
no `Unload` of a version a live request uses), capacity, and no load ping-pong in its strict
form: an instance is told to load at most once per change of the inputs (a multi-version one
at most once per version). A change of the inputs is a publish, a roll-back, an
instance added or removed, a request placed (`place` that returns an instance), resized to
another size, or ended, and a demand report of another value; a load completion alone is none,
so the loads it leads to may not re-target an instance told to load since the last change.
At the end, with the inputs frozen but loads completing and requests ending, every parked
request is resumed or failed with a reason, and the orchestrator's backstop against a second
load (`held_back_loads`) never acts: the rules alone keep the property. Derandomized, so that it
runs the same 1,000 examples everywhere. The known counterexample of a parked version given one
instance per plan (instead of its whole need at once) is a unit test
(`test_a_parked_version_takes_its_whole_need_in_one_plan`): these examples found it only with
some seeds."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from dora.core.orchestrator import (
    Action,
    Drain,
    Fail,
    Load,
    Migrate,
    Mode,
    Orchestrator,
    Park,
    Resume,
    Undrain,
    Unload,
)


class Driver(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.o = Orchestrator(mode=Mode.DORA)
        self.n_instances = 0
        self.n_requests = 0
        self.loads: dict[int, Load] = {}  # every Load not yet reported, superseded ones too
        self.version: dict[str, int] = {}  # live request -> the version it was born with
        self.failed: set[str] = set()
        # instance (with the version, on a multi-version one) -> its Load since the inputs changed
        self.told: dict[str | tuple[str, int], Load] = {}
        self.tokens: dict[str, int | None] = {}  # instance -> its token limit
        self.size: dict[str, int] = {}  # request -> its last reported size
        self.multi: set[str] = set()  # the multi-version instances

    # --- the driver's side of each action -------------------------------------------------

    def apply(self, actions: list[Action]) -> None:
        views = {v.id: v for v in self.o.instances()}
        for a in actions:
            if isinstance(a, Load):
                self.loads[a.id] = a
                key = (a.instance, a.version) if a.instance in self.multi else a.instance
                first = self.told.get(key)
                assert first is None, f"{a.instance} told {first} then {a} for one input change"
                self.told[key] = a
            elif isinstance(a, Migrate | Resume):
                where = a.dst if isinstance(a, Migrate) else a.instance
                v = views[where]
                assert self.version[a.request] in self.o.held_versions(where), (a, v)  # C1
                if isinstance(a, Resume):
                    assert a.version == self.version[a.request]
            elif isinstance(a, Fail):
                assert self.o.location(a.request) is None  # parked (a Park came first)
                self.failed.add(a.request)
            elif isinstance(a, Unload):
                assert a.instance in self.multi and a.version not in (0, self.o.newest)
                assert a.version not in self.o.live(), a  # no lease of it is left anywhere
                assert a.version not in self.o.held_versions(a.instance)
            else:
                assert isinstance(a, Park | Drain | Undrain)

    def input_changed(self) -> None:
        self.told = {}

    def end(self, rid: str) -> None:
        self.input_changed()
        self.apply(self.o.finish(rid))
        del self.version[rid]
        self.size.pop(rid, None)
        self.failed.discard(rid)

    def end_failed(self) -> None:
        """A failed request's episode ends at once (the driver fails it and finishes it)."""
        for rid in sorted(self.failed):
            self.end(rid)

    # --- inputs -------------------------------------------------------------------------------

    @initialize(
        capacities=st.lists(st.integers(1, 3), min_size=1, max_size=3),
        sizes=st.lists(st.integers(0, 80) | st.integers(40, 60), max_size=6),
    )
    def start(self, capacities: list[int], sizes: list[int]) -> None:
        """A loaded pool with token limits, running requests of version 0 of the given sizes
        (packing by slots alone, so an instance may already be over its tokens)."""
        for capacity in capacities:
            self.add_instance(capacity, 100)
        while self.loads:
            self.apply(self.o.on_loaded(self.loads.pop(min(self.loads))))
        for size in sizes:
            self.start_group(1)
            rid = f"r{self.n_requests - 1}"
            if rid in self.version:
                self.size[rid] = size
                self.input_changed()
                self.apply(self.o.set_size(rid, size))
        self.input_changed()

    @rule(
        capacity=st.integers(1, 3),
        tokens=st.sampled_from([None, 60, 100, 150]),
        ready=st.booleans(),
        multi=st.booleans(),
    )
    def add_instance(
        self, capacity: int, tokens: int | None, ready: bool = False, multi: bool = False
    ) -> None:
        """An instance joins; with `ready` its first load completes at once (an empty instance
        of the newest version beside old versions' loaded ones, where a parked request's load
        and the newest version's can ping-pong)."""
        self.input_changed()
        self.n_instances += 1
        iid = f"i{self.n_instances}"
        self.tokens[iid] = tokens
        if multi:
            self.multi.add(iid)
        self.apply(self.o.add_instance(iid, capacity=capacity, tokens=tokens, multi_version=multi))
        pending = [load for load in self.loads.values() if load.instance == iid]
        if ready and pending and self.o.is_pending(pending[-1]):
            del self.loads[pending[-1].id]
            self.apply(self.o.on_loaded(pending[-1]))

    @precondition(lambda self: self.o.instances())
    @rule(data=st.data(), old_holder=st.booleans())
    def kill_instance(self, data: st.DataObject, old_holder: bool) -> None:
        """An instance dies; biased toward one holding requests of an old version (they park
        or migrate within their version, the cases where loads can ping-pong)."""
        self.input_changed()
        views = sorted(self.o.instances(), key=lambda v: v.id)
        old = [v.id for v in views if v.load and v.version != self.o.newest]
        pool = old if old_holder and old else [v.id for v in views]
        victim = data.draw(st.sampled_from(pool))
        self.apply(self.o.remove_instance(victim))
        self.end_failed()

    @precondition(lambda self: self.o.instances())
    @rule(data=st.data(), capacity=st.integers(1, 2))
    def replace_instance(self, data: st.DataObject, capacity: int) -> None:
        """An instance holding an old version's requests dies and a small fresh one takes its
        place: its requests park and need several instances at once, while the fresh one and
        those told to load the newest version are spare (one instance per plan would let a
        later load completion re-target one of them)."""
        self.kill_instance(data, old_holder=True)
        self.add_instance(capacity, 100)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        load = self.loads.pop(data.draw(st.sampled_from(sorted(self.loads))))
        accepted = self.o.is_pending(load)
        before = self.o.stale_loads
        self.apply(self.o.on_loaded(load))
        assert self.o.stale_loads == before + (not accepted)

    @rule(n=st.integers(1, 2))
    def start_group(self, n: int) -> None:
        w = self.o.newest
        rids = [f"r{self.n_requests + j}" for j in range(n)]
        where = self.o.place(rids, version=w)
        if where is None:
            return  # nothing changed
        self.input_changed()
        self.n_requests += n
        view = next(v for v in self.o.instances() if v.id == where)
        assert w in self.o.held_versions(where) and view.load <= view.capacity  # C1
        for rid in rids:
            self.version[rid] = w

    @precondition(lambda self: self.version)
    @rule(data=st.data(), tokens=st.integers(0, 160), near=st.integers(-12, 12))
    def grow_request(self, data: st.DataObject, tokens: int, near: int) -> None:
        """A request's context grows; half the time to within a few tokens of what is left of
        its instance's (or some instance's) token limit, where packing by slots and by tokens
        disagree."""
        rid = data.draw(st.sampled_from(sorted(self.version)))
        if data.draw(st.booleans()):
            where = self.o.location(rid)
            limit = None if where is None else self.tokens[where]
            if limit is not None:
                used = sum(self.size.get(r, 0) for r in self.version if self.o.location(r) == where)
                tokens = max(0, limit - used + self.size.get(rid, 0) + near)
            elif limits := sorted({t for t in self.tokens.values() if t is not None}):
                tokens = max(0, data.draw(st.sampled_from(limits)) // 2 + near)
        if tokens != self.size.get(rid, 0):
            self.input_changed()
        self.size[rid] = tokens
        self.apply(self.o.set_size(rid, tokens))
        self.end_failed()

    @precondition(lambda self: self.version)
    @rule(data=st.data())
    def end_request(self, data: st.DataObject) -> None:
        self.input_changed()
        self.end(data.draw(st.sampled_from(sorted(self.version))))
        self.end_failed()

    @precondition(lambda self: self.o.newest < 6)
    @rule()
    def publish(self) -> None:
        self.input_changed()
        self.apply(self.o.publish(self.o.newest + 1))
        self.end_failed()

    @precondition(lambda self: self.o.newest > 0)
    @rule(data=st.data())
    def roll_back(self, data: st.DataObject) -> None:
        self.input_changed()
        newest = data.draw(st.integers(0, self.o.newest - 1))
        ghosts = [r for r, w in self.version.items() if w > newest]
        self.apply(self.o.rollback(newest))
        for rid in ghosts:
            assert not self.o.is_live(rid)
            del self.version[rid]
            self.size.pop(rid, None)
            self.failed.discard(rid)
        self.end_failed()

    @rule(requests=st.integers(0, 6))
    def demand(self, requests: int) -> None:
        if requests != self.o.demand:
            self.input_changed()
        self.apply(self.o.set_demand(requests))

    # --- after every step ---------------------------------------------------------------------

    @invariant()
    def placements_hold_their_version(self) -> None:
        views = {v.id: v for v in self.o.instances()}
        for v in views.values():
            assert 0 <= v.load <= v.capacity
        for rid, w in self.version.items():
            assert self.o.is_live(rid) and self.o.request_version(rid) == w
            where = self.o.location(rid)
            if where is not None:
                assert w in self.o.held_versions(where), (rid, views[where])  # C1
        assert sum(self.o.live().values()) == len(self.version)

    @invariant()
    def no_load_held_back(self) -> None:
        """The rules alone keep to one load per instance per change of the inputs: the
        orchestrator's backstop (a load it leaves for the next change) never acts."""
        assert self.o.held_back_loads == 0

    def teardown(self) -> None:
        """Freeze the inputs: loads complete and requests end (newest first, so that old
        versions keep theirs); every parked request must be resumed or failed on the way."""
        if not self.o.instances():
            self.input_changed()
            self.tokens["last"] = 100
            self.apply(self.o.add_instance("last", capacity=2, tokens=100))
            self.end_failed()
        for _ in range(10 * (len(self.version) + len(self.loads)) + 10):
            parked = [r for r in self.version if self.o.location(r) is None]
            if not parked:
                return
            if self.loads:
                self.apply(self.o.on_loaded(self.loads.pop(min(self.loads))))
                self.end_failed()
                continue
            running = [r for r in self.version if self.o.location(r) is not None]
            assert running, f"parked {parked} with nothing running and no load coming"
            self.input_changed()
            self.end(max(running, key=lambda r: (self.version[r], r)))
            self.end_failed()
        raise AssertionError(f"parked requests never resumed: {self.o.instances()}")


Driver.TestCase.settings = settings(
    max_examples=1000, stateful_step_count=40, deadline=None, derandomize=True
)
test_orchestrator_as_a_driver_sees_it = Driver.TestCase
