"""Unit tests of the orchestrator: each rule of docs/scheduling.md on a small, explicit pool."""

from __future__ import annotations

import time

import pytest

from dora.core.orchestrator import (
    Drain,
    Load,
    Migrate,
    Mode,
    Orchestrator,
    Park,
    Resume,
    Undrain,
)
from dora.errors import SchedulingError


def pool(mode: Mode, n: int, capacity: int) -> Orchestrator:
    o = Orchestrator(mode=mode)
    for i in range(n):
        assert o.add_instance(f"i{i}", capacity=capacity) == [Load(f"i{i}", 0)]
        assert o.on_loaded(f"i{i}", 0) == []
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
    assert actions == [Migrate("d", "i1", "i0"), Load("i1", 1)]
    o.finish("b")
    assert o.finish("d") == [Load("i0", 1)]  # never zero instances while R_0 > 0, then released


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
    o.on_loaded("i1", 1)
    o.place(["n1"], version=1)
    actions = o.remove_instance("i0")
    assert actions[:2] == [Park("a", "i0"), Park("b", "i0")]
    # Version 0 is on the trainer's critical path: the only instance drains for it.
    assert actions[2:] == [Drain("i1")]
    assert o.place(["n2"], version=1) is None
    assert o.finish("n1") == [Load("i1", 0)]
    assert o.on_loaded("i1", 0) == [Resume("a", "i1", 0), Resume("b", "i1", 0)]


def test_fewer_instances_than_versions_serves_oldest_first() -> None:
    o = pool(Mode.DORA, 1, 1)
    o.add_instance("i1", capacity=1)
    o.on_loaded("i1", 0)
    o.place(["a"], version=0)
    o.publish(1)
    o.on_loaded("i1", 1)
    o.place(["b"], version=1)
    o.publish(2)
    o.remove_instance("i1")  # b (version 1) parks; i0 holds version 0
    o.add_instance("i2", capacity=1)  # a fresh instance goes to the oldest waiting version
    assert o.instances()[-1].version == 1
    assert o.on_loaded("i2", 1) == [Resume("b", "i2", 1)]


def test_one_step_off_drains_then_switches_all_together() -> None:
    o = pool(Mode.ONE_STEP_OFF, 2, 2)
    o.place(["a"], version=0)
    assert o.publish(1) == [Drain("i0"), Drain("i1")]
    assert o.place(["b"], version=0) is None  # no new group of the old version
    assert o.loaded_versions() == {0}
    assert o.finish("a") == [Load("i0", 1), Load("i1", 1)]
    o.on_loaded("i0", 1)
    assert o.place(["b"], version=1) == "i0"


def test_partial_parks_loads_and_resumes_on_the_new_version() -> None:
    o = pool(Mode.PARTIAL, 1, 2)
    o.place(["a", "b"], version=0)
    assert o.publish(1) == [Park("a", "i0"), Park("b", "i0"), Load("i0", 1)]
    assert o.on_loaded("i0", 1) == [Resume("a", "i0", 1), Resume("b", "i0", 1)]
    assert o.live() == {1: 2}


def test_rollback_forgets_ghost_requests_and_reloads() -> None:
    o = pool(Mode.DORA, 1, 2)
    o.publish(1)
    o.on_loaded("i0", 1)
    o.place(["ghost"], version=1)
    assert o.rollback(0) == [Load("i0", 0)]
    assert o.live() == {}
    with pytest.raises(SchedulingError):
        o.finish("ghost")


def test_a_drain_lifted_without_a_load_is_reported() -> None:
    o = pool(Mode.DORA, 2, 2)
    o.place(["a", "b"], version=0)
    o.publish(1)
    o.on_loaded("i1", 1)
    o.place(["n1"], version=1)
    assert o.remove_instance("i0")[2:] == [Drain("i1")]  # version 0's requests wait for room
    assert o.add_instance("i2", capacity=2) == [Load("i2", 0)]  # ...and get a fresh instance
    assert o.on_loaded("i2", 0) == [Resume("a", "i2", 0), Resume("b", "i2", 0)]
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
    assert o.publish(1) == [Load("i3", 1)]
    assert o.finish("r0") == [Load("i0", 1)]  # an emptied instance still moves to the newest
    o.on_loaded("i3", 1)
    o.on_loaded("i0", 1)
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
    assert o.publish(1) == [Load("i2", 1)]
    assert o.set_demand(4) == []  # i2 is loading version 1 and will take the 4 waiting samples
    assert o.set_demand(5) == [Migrate("b", "i1", "i0"), Load("i1", 1)]


def test_consolidation_respects_kv_token_capacity() -> None:
    def run(tokens: int | None) -> list[Migrate]:
        o = Orchestrator(mode=Mode.DORA)
        for i in range(3):
            o.add_instance(f"i{i}", capacity=4, tokens=tokens)
            o.on_loaded(f"i{i}", 0)
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
        o.on_loaded(f"i{i}", 0)
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
        o.on_loaded(f"i{i}", 0)
    for i in range(n):
        assert o.place([f"r{i}/0", f"r{i}/1"], version=0) == f"i{i}"
    o.set_demand(0)
    loads = [a for a in o.publish(1) if isinstance(a, Load)]
    for i in range(n):
        o.finish(f"r{i}/0")
        loads += [a for a in o.finish(f"r{i}/1") if isinstance(a, Load)]
    for a in loads:
        o.on_loaded(a.instance, 1)
    assert len(loads) == n and o.live() == {}
    for i in range(n):
        assert o.place([f"s{i}/0", f"s{i}/1"], version=1) is not None
    # A pass over the pool per event (the old planner) takes minutes here.
    assert time.perf_counter() - start < 20
