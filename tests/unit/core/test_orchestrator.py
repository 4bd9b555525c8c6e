"""Unit tests of the orchestrator: each rule of docs/scheduling.md on a small, explicit pool."""

from __future__ import annotations

import dataclasses
import time

import pytest

from dora.core import Admitted, GroupState, TransferQueue, rollback
from dora.core.orchestrator import (
    Action,
    Drain,
    Fail,
    FailReason,
    Load,
    Migrate,
    Mode,
    Orchestrator,
    Park,
    Resume,
    Undrain,
)
from dora.errors import SchedulingError


def shape(actions: list[Action]) -> list[Action]:
    """The actions with the loads' ids left out (tests name loads by instance and version)."""
    return [dataclasses.replace(a, id=0) if isinstance(a, Load) else a for a in actions]


def loaded(o: Orchestrator, instance: str, version: int) -> list[Action]:
    """Report the instance's pending load (which must be of `version`) as done."""
    load = o.pending_load(instance)
    assert load is not None and load.version == version, (instance, load)
    return o.on_loaded(load)


def pool(mode: Mode, n: int, capacity: int) -> Orchestrator:
    o = Orchestrator(mode=mode)
    for i in range(n):
        assert shape(o.add_instance(f"i{i}", capacity=capacity)) == [Load(f"i{i}", 0)]
        assert loaded(o, f"i{i}", 0) == []
    return o


def test_place_respects_capacity_and_version() -> None:
    o = pool(Mode.DORA, 1, 3)
    assert o.place(["a", "b"], version=0) == "i0"
    assert o.place(["c", "d"], version=0) is None  # one slot left, the group needs two
    assert o.place(["c"], version=1) is None
    assert o.place(["c"], version=0) == "i0"
    o.finish("a")
    with pytest.raises(SchedulingError):
        o.place(["c"], version=0)


def test_new_version_consolidates_old_and_frees_whole_instances() -> None:
    o = pool(Mode.DORA, 3, 4)
    for i, where in enumerate(["i0", "i1", "i2"]):
        assert o.place([f"r{i}"], version=0) == where
    actions = o.publish(1)
    # Version 0 has 3 live requests: one instance holds them; two migrate, two instances load 1.
    migrations = [a for a in actions if isinstance(a, Migrate)]
    loads = [a for a in actions if isinstance(a, Load)]
    assert len(migrations) == 2 and len({m.dst for m in migrations}) == 1
    assert sorted(a.instance for a in loads) == sorted({"i0", "i1", "i2"} - {migrations[0].dst})
    assert all(a.version == 1 for a in loads)
    assert o.live() == {0: 3}


def test_old_version_keeps_an_instance_while_it_has_live_requests() -> None:
    o = pool(Mode.DORA, 2, 2)
    o.place(["a", "b"], version=0)
    o.place(["c", "d"], version=0)
    assert [a for a in o.publish(1) if isinstance(a, Load)] == []  # no whole instance is free
    assert o.finish("a") == []  # i0 still holds b; i1 is full: nothing moves
    actions = o.finish("c")
    assert shape(actions) == [Migrate("d", "i1", "i0"), Load("i1", 1)]
    o.finish("b")
    assert shape(o.finish("d")) == [
        Load("i0", 1)
    ]  # never zero instances while R_0 > 0, then released


def test_dead_instance_requests_migrate_within_their_version() -> None:
    o = pool(Mode.DORA, 2, 4)
    o.place(["a"], version=0)
    o.place(["b"], version=0)
    assert o.remove_instance("i0") == [Migrate("a", "i0", "i1")]
    assert o.location("a") == "i1"


def test_dead_instance_without_peer_parks_and_reloads_its_version() -> None:
    o = pool(Mode.DORA, 2, 2)
    o.place(["a", "b"], version=0)
    o.publish(1)  # i1 (empty) loads version 1; i0 keeps version 0
    loaded(o, "i1", 1)
    o.place(["n1"], version=1)
    actions = o.remove_instance("i0")
    assert actions[:2] == [Park("a", "i0"), Park("b", "i0")]
    # Version 0 is on the trainer's critical path: the only instance drains for it.
    assert actions[2:] == [Drain("i1")]
    assert o.place(["n2"], version=1) is None
    assert shape(o.finish("n1")) == [Load("i1", 0)]
    assert loaded(o, "i1", 0) == [Resume("a", "i1", 0), Resume("b", "i1", 0)]


def test_fewer_instances_than_versions_serves_oldest_first() -> None:
    o = pool(Mode.DORA, 1, 1)
    o.add_instance("i1", capacity=1)
    loaded(o, "i1", 0)
    o.place(["a"], version=0)
    o.publish(1)
    loaded(o, "i1", 1)
    o.place(["b"], version=1)
    o.publish(2)
    o.remove_instance("i1")  # b (version 1) parks; i0 holds version 0
    o.add_instance("i2", capacity=1)  # a fresh instance goes to the oldest waiting version
    assert o.instances()[-1].version == 1
    assert loaded(o, "i2", 1) == [Resume("b", "i2", 1)]


def test_one_step_off_drains_then_switches_all_together() -> None:
    o = pool(Mode.ONE_STEP_OFF, 2, 2)
    o.place(["a"], version=0)
    assert o.publish(1) == [Drain("i0"), Drain("i1")]
    assert o.place(["b"], version=0) is None  # no new group of the old version
    assert o.loaded_versions() == {0}
    assert shape(o.finish("a")) == [Load("i0", 1), Load("i1", 1)]
    loaded(o, "i0", 1)
    assert o.place(["b"], version=1) == "i0"


def test_partial_parks_loads_and_resumes_on_the_new_version() -> None:
    o = pool(Mode.PARTIAL, 1, 2)
    o.place(["a", "b"], version=0)
    assert shape(o.publish(1)) == [Park("a", "i0"), Park("b", "i0"), Load("i0", 1)]
    assert loaded(o, "i0", 1) == [Resume("a", "i0", 1), Resume("b", "i0", 1)]
    assert o.live() == {1: 2}


def test_rollback_forgets_ghost_requests_and_reloads() -> None:
    o = pool(Mode.DORA, 1, 2)
    o.publish(1)
    loaded(o, "i0", 1)
    o.place(["ghost"], version=1)
    assert shape(o.rollback(0)) == [Load("i0", 0)]
    assert o.live() == {}
    with pytest.raises(SchedulingError):
        o.finish("ghost")


def test_a_drain_lifted_without_a_load_is_reported() -> None:
    o = pool(Mode.DORA, 2, 2)
    o.place(["a", "b"], version=0)
    o.publish(1)
    loaded(o, "i1", 1)
    o.place(["n1"], version=1)
    assert o.remove_instance("i0")[2:] == [Drain("i1")]  # version 0's requests wait for room
    assert shape(o.add_instance("i2", capacity=2)) == [Load("i2", 0)]  # ...and get a fresh instance
    assert loaded(o, "i2", 0) == [Resume("a", "i2", 0), Resume("b", "i2", 0)]
    assert not o.accepts("i1")
    # i1 empties; nobody waits any more, so it stays on version 1 and takes groups again.
    assert o.finish("n1") == [Undrain("i1")]
    assert o.accepts("i1") and o.place(["n2"], version=1) == "i1"


def test_old_version_is_consolidated_only_when_the_newest_needs_room() -> None:
    o = pool(Mode.DORA, 4, 4)
    for i in range(3):
        o.place([f"r{i}"], version=0)
    assert o.set_demand(0) == []
    # Nothing waits: the idle instance loads version 1, the busy ones keep their requests.
    assert shape(o.publish(1)) == [Load("i3", 1)]
    assert shape(o.finish("r0")) == [Load("i0", 1)]  # an emptied instance still moves to the newest
    loaded(o, "i3", 1)
    loaded(o, "i0", 1)
    for n in range(2):
        assert o.place([f"n{n}/{j}" for j in range(4)], version=1) is not None
    # Now groups wait and version 1 has no room coming: version 0 packs onto one instance.
    actions = o.set_demand(4)
    assert [type(a) for a in actions] == [Migrate, Load]
    assert o.set_demand(8) == []  # already consolidating: nothing new to free
    assert o.live() == {0: 2, 1: 8}


def test_demand_covered_by_loading_instances_does_not_consolidate() -> None:
    o = pool(Mode.DORA, 3, 4)
    o.place(["a"], version=0)
    o.place(["b"], version=0)
    o.set_demand(0)
    assert shape(o.publish(1)) == [Load("i2", 1)]
    assert o.set_demand(4) == []  # i2 is loading version 1 and will take the 4 waiting samples
    assert shape(o.set_demand(5)) == [Migrate("b", "i1", "i0"), Load("i1", 1)]


def test_a_demand_one_instance_covers_frees_one_instance_not_one_per_old_version() -> None:
    o = pool(Mode.DORA, 6, 4)
    o.set_demand(0)
    assert [o.place([f"a{i}"], version=0) for i in range(2)] == ["i0", "i1"]
    o.publish(1)
    for i in range(2, 6):
        loaded(o, f"i{i}", 1)
    assert [o.place([f"b{i}"], version=1) for i in range(4)] == ["i2", "i3", "i4", "i5"]
    assert o.publish(2) == []  # nothing waits for version 2 yet
    # One group (4 samples, one instance's worth) waits for version 2: the oldest version packs
    # onto one instance and the freed one loads version 2. Version 1 could free three more, but
    # the waiting group needs none of them.
    assert shape(o.set_demand(4)) == [Migrate("a1", "i1", "i0"), Load("i1", 2)]
    assert o.live() == {0: 2, 1: 4}
    assert sorted(i.id for i in o.instances() if i.version == 1) == ["i2", "i3", "i4", "i5"]
    # More waits than i1 will take: version 1 packs as well, but only as much as is needed.
    actions = shape(o.set_demand(5))
    assert [type(a) for a in actions] == [Migrate, Load]


def test_consolidation_respects_kv_token_capacity() -> None:
    def run(tokens: int | None) -> list[Migrate]:
        o = Orchestrator(mode=Mode.DORA)
        for i in range(3):
            o.add_instance(f"i{i}", capacity=4, tokens=tokens)
            loaded(o, f"i{i}", 0)
        for i, size in enumerate([60, 60, 10]):
            o.place([f"r{i}"], version=0)
            o.set_size(f"r{i}", size)
        return [a for a in o.publish(1) if isinstance(a, Migrate)]

    assert len(run(None)) == 2  # by slots alone, one instance holds all three
    moves = run(100)  # 60 + 60 tokens do not fit in 100: only the short request moves
    assert moves == [Migrate("r2", "i2", "i0")]


def test_place_and_resume_respect_kv_tokens_on_failure() -> None:
    o = Orchestrator(mode=Mode.DORA)
    for i in range(3):
        o.add_instance(f"i{i}", capacity=4, tokens=100)
        loaded(o, f"i{i}", 0)
    o.place(["a"], version=0)
    o.set_size("a", 90)
    o.place(["b"], version=0)
    o.set_size("b", 50)
    o.place(["c"], version=0)
    o.set_size("c", 50)
    # i0 dies: `a` (90 tokens) fits neither i1 nor i2 (50 used of 100 each), so it parks.
    assert o.remove_instance("i0")[0] == Park("a", "i0")


def test_planning_cost_does_not_grow_with_the_square_of_the_pool() -> None:
    n = 8192
    o = Orchestrator(mode=Mode.DORA)
    start = time.perf_counter()
    for i in range(n):
        o.add_instance(f"i{i}", capacity=4)
        loaded(o, f"i{i}", 0)
    for i in range(n):
        assert o.place([f"r{i}/0", f"r{i}/1"], version=0) == f"i{i}"
    o.set_demand(0)
    loads = [a for a in o.publish(1) if isinstance(a, Load)]
    for i in range(n):
        o.finish(f"r{i}/0")
        loads += [a for a in o.finish(f"r{i}/1") if isinstance(a, Load)]
    for a in loads:
        loaded(o, a.instance, 1)
    assert len(loads) == n and o.live() == {}
    for i in range(n):
        assert o.place([f"s{i}/0", f"s{i}/1"], version=1) is not None
    # A pass over the pool per event (the old planner) takes minutes here.
    assert time.perf_counter() - start < 20


def test_token_limits_do_not_ping_pong_a_load() -> None:
    # `a` is over its token limit (110 of 100), so version 0 needs a second instance for r2; the
    # rule must count tokens as it counts slots, and resume r2 before it re-targets `c`.
    o = Orchestrator(mode=Mode.DORA)
    o.add_instance("a", capacity=3, tokens=100)
    loaded(o, "a", 0)
    o.place(["r1"], version=0)
    o.place(["r3"], version=0)
    o.add_instance("b", capacity=3, tokens=100)
    loaded(o, "b", 0)
    o.place(["r2"], version=0)
    o.set_size("r1", 60)
    o.set_size("r3", 50)
    o.set_size("r2", 10)
    o.publish(1)
    o.add_instance("c", capacity=3, tokens=100)
    loaded(o, "c", 1)
    assert shape(o.remove_instance("b")) == [Park("r2", "b"), Load("c", 0)]
    assert loaded(o, "c", 0) == [Resume("r2", "c", 0)]
    assert o.location("r2") == "c"


def test_a_drained_instance_does_not_load_a_version_already_on_its_way() -> None:
    # r0 (version 0) is parked and `c` is loading version 0 for it; `b` (version 1) drained for
    # it before `c` came. Once `b` empties it must not load version 0 too: `c`'s completion
    # would take r0 and re-target `b` (two loads of one instance for one change of the inputs).
    o = pool(Mode.DORA, 1, 1)
    o.place(["r0"], version=0)
    o.publish(1)
    o.add_instance("b", capacity=1)
    loaded(o, "b", 1)
    assert o.place(["n1"], version=1) == "b"
    assert o.remove_instance("i0") == [Park("r0", "i0"), Drain("b")]
    assert shape(o.add_instance("c", capacity=1)) == [Load("c", 0)]
    assert o.finish("n1") == [Undrain("b")]
    assert loaded(o, "c", 0) == [Resume("r0", "c", 0)]


def test_a_load_that_was_superseded_is_not_accepted() -> None:
    o = pool(Mode.DORA, 2, 2)
    o.place(["r1"], version=0)  # on i0
    [first] = o.publish(1)
    assert shape([first]) == [Load("i1", 1)]
    assert shape(o.remove_instance("i0")) == [Park("r1", "i0"), Load("i1", 0)]
    [third] = o.finish("r1")
    assert shape([third]) == [Load("i1", 1)] and third != first
    # The first load's completion names version 1 too, but it is not the pending load.
    assert o.on_loaded(first) == [] and o.stale_loads == 1
    assert not o.accepts("i1")
    assert o.on_loaded(third) == [] and o.accepts("i1")


def test_a_ghost_versions_load_is_not_accepted_after_a_rollback() -> None:
    o = pool(Mode.DORA, 1, 2)
    o.publish(1)
    loaded(o, "i0", 1)
    [ghost] = o.publish(2)
    assert shape(o.rollback(1)) == [Load("i0", 1)]
    [real] = o.publish(2)
    assert (real.version, ghost.version) == (2, 2) and real != ghost
    assert o.on_loaded(ghost) == [] and not o.accepts("i0")
    assert o.on_loaded(real) == [] and o.accepts("i0")


def test_a_request_longer_than_every_instance_fails_with_a_reason() -> None:
    o = Orchestrator(mode=Mode.DORA)
    for i, tokens in enumerate([100, 80]):
        o.add_instance(f"i{i}", capacity=2, tokens=tokens)
        loaded(o, f"i{i}", 0)
    o.place(["a"], version=0)
    o.place(["b"], version=0)
    assert o.set_size("a", 90) == []  # fits i0 (100 tokens)
    assert o.set_size("a", 101) == [Park("a", "i0"), Fail("a", FailReason.TOO_LONG)]
    assert o.failures() == {FailReason.TOO_LONG: 1}
    assert o.location("a") is None and o.live() == {0: 2}  # the lease holds until `finish`
    assert o.finish("a") == []
    # An instance that dies can leave a request with nowhere to go either.
    assert o.location("b") == "i1"
    assert o.place(["c"], version=0) == "i0"
    assert o.set_size("c", 90) == []
    assert o.remove_instance("i0") == [Park("c", "i0"), Fail("c", FailReason.TOO_LONG)]
    assert o.failures() == {FailReason.TOO_LONG: 2}
    o.finish("c")
    assert o.live() == {0: 1}


def test_partial_rollback_does_not_resume_a_kept_group_on_the_ghost() -> None:
    q = TransferQueue(groups_per_step=1, max_staleness=2)
    o = pool(Mode.PARTIAL, 2, 1)
    q.on_version_loaded(0)
    for gid in ("A", "B", "C"):
        assert isinstance(q.try_admit(gid), Admitted)
        q.start(gid)
    assert o.place(["a"], version=0) == "i0" and o.place(["b"], version=0) == "i1"
    q.complete("C")  # fills step 0
    q.on_step_done(0)
    o.publish(1)
    assert loaded(o, "i0", 1) == [Resume("a", "i0", 1)]
    o.publish(2)  # version 2 will be a ghost: the trainer restarts from step 0
    assert loaded(o, "i0", 2) == [Resume("b", "i0", 2)]  # b now holds ghost tokens
    out = rollback(q, o, 0, tainted={"B"}, requests=lambda gid: [gid.lower()])
    assert out.report.rolled_back == ("B",)
    assert not o.is_live("b")
    # A (version 0, parked at version 1) is kept by both halves and resumes on version 1.
    assert o.is_live("a") and o.request_version("a") == 1 and q.state("A") is GroupState.STARTED
    for load in [a for a in out.actions if isinstance(a, Load)]:
        assert load.version == 1
        o.on_loaded(load)
    assert o.location("a") is not None and o.request_version("a") == 1


def complete_loads(o: Orchestrator, actions: list[Action]) -> list[Action]:
    """Report every pending load done, oldest first, until none is left (no other input);
    returns every action on the way, `actions` (the last input's) first."""
    out = list(actions)
    while pending := [p for v in o.instances() if (p := o.pending_load(v.id)) is not None]:
        out += o.on_loaded(min(pending, key=lambda a: a.id))
    return out


def test_a_parked_version_takes_its_whole_need_in_one_plan() -> None:
    # Three requests of version 0 sit on `i3`, which dies; `i1` and `i2` (one slot each) were
    # told to load version 1. Version 0 needs three slots: taking one instance per plan made
    # `i1`'s load completion take `i4`, which the same input (its joining) had told to load
    # version 1: two loads of one instance for one change of the inputs.
    o = Orchestrator(mode=Mode.DORA)
    for iid, capacity in [("i1", 1), ("i2", 1), ("i3", 3)]:
        o.add_instance(iid, capacity=capacity, tokens=100)
        loaded(o, iid, 0)
    for rid in ["r0", "r1", "r2"]:
        assert o.place([rid], version=0) is not None
        o.set_size(rid, 0)
    o.publish(1)
    assert {o.location(r) for r in ["r0", "r1", "r2"]} == {"i3"}
    o.remove_instance("i3")
    after = complete_loads(o, o.add_instance("i4", capacity=1, tokens=100))
    told = [a.instance for a in after if isinstance(a, Load)]
    assert len(told) == len(set(told)), after
    assert all(o.location(r) is not None for r in ["r0", "r1", "r2"]), after
