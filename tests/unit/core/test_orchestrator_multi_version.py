"""Multi-version instances (versions as adapters over one base model): a new version loads
beside the ones in use, with no drain and no migration; placements go to any instance holding
the version; a version no request needs is unloaded (never version 0, the base)."""

from __future__ import annotations

from dora.core.orchestrator import (
    Action,
    Drain,
    Load,
    Migrate,
    Mode,
    Orchestrator,
    Park,
    Resume,
    Unload,
)


def done(o: Orchestrator, actions: list[Action]) -> list[Action]:
    """Report every `Load` in `actions` as finished, in order; the other actions, with what the
    completions returned (and their loads reported too)."""
    rest: list[Action] = []
    for a in actions:
        if isinstance(a, Load):
            assert o.is_pending(a)
            rest += done(o, o.on_loaded(a))
        else:
            rest.append(a)
    return rest


def multi_pool(n: int, capacity: int, *, newest: int = 0) -> Orchestrator:
    o = Orchestrator(mode=Mode.DORA, newest=newest)
    for i in range(n):
        [load] = o.add_instance(f"i{i}", capacity=capacity, multi_version=True)
        assert load.instance == f"i{i}" and load.version == newest
        assert done(o, [load]) == []
    return o


def test_three_versions_live_on_two_instances_without_drain_or_migration() -> None:
    o = multi_pool(2, 4)
    assert o.place(["a", "b"], version=0) == "i0"
    assert o.place(["c", "d"], version=0) == "i1"
    publish = o.publish(1)
    assert [(a.instance, a.version) for a in publish if isinstance(a, Load)] == [
        ("i0", 1),
        ("i1", 1),
    ]
    assert all(isinstance(a, Load) for a in publish)  # no Drain, Migrate or Park
    assert o.place(["x"], version=1) is None  # not loaded yet: C1
    assert done(o, publish) == []
    assert o.place(["e", "f"], version=1) == "i0"
    assert done(o, o.publish(2)) == []
    assert o.place(["g"], version=2) == "i1"  # i0 is full: slots are shared by its versions
    assert o.live() == {0: 4, 1: 2, 2: 1}
    assert o.held_versions("i0") == o.held_versions("i1") == {0, 1, 2}
    assert o.place(["h"], version=1) == "i1"  # an old version still held takes new leases
    assert o.finish("e") == []
    assert o.finish("h") == []  # a lease of version 1 is left (f)
    # The last lease of version 1 ends: every instance unloads it, nothing else moves.
    assert o.finish("f") == [Unload("i0", 1), Unload("i1", 1)]
    assert o.place(["y"], version=1) is None
    for rid in "abcd":
        assert o.finish(rid) == []  # version 0 is the base model: never unloaded
    assert o.held_versions("i0") == {0, 2}
    assert done(o, o.publish(3)) == []  # version 2 still has a lease (g)
    assert o.finish("g") == [Unload("i0", 2), Unload("i1", 2)]
    assert o.held_versions("i1") == {0, 3}


def test_a_dead_instance_s_requests_move_to_an_instance_holding_their_version() -> None:
    o = multi_pool(2, 4)
    assert done(o, o.publish(1)) == []
    assert o.place(["a", "b"], version=1) == "i0"
    assert o.remove_instance("i0") == [Migrate("a", "i0", "i1"), Migrate("b", "i0", "i1")]


def test_a_parked_version_is_loaded_beside_the_others_without_a_drain() -> None:
    o = multi_pool(1, 4, newest=1)
    assert o.place(["a"], version=1) == "i0"
    assert done(o, o.publish(2)) == []
    [load] = o.add_instance("i1", capacity=4, multi_version=True)
    assert (load.instance, load.version) == ("i1", 2)
    assert done(o, [load]) == []
    assert o.place(["b"], version=2) == "i1"
    actions = o.remove_instance("i0")  # i1 does not hold version 1: it loads it, b keeps running
    assert actions[0] == Park("a", "i0")
    assert [(a.instance, a.version) for a in actions[1:] if isinstance(a, Load)] == [("i1", 1)]
    assert not any(isinstance(a, Drain) for a in actions)
    assert done(o, actions[1:]) == [Resume("a", "i1", 1)]
    assert o.location("b") == "i1"
    assert o.finish("a") == [Unload("i1", 1)]


def test_a_rollback_unloads_the_ghost_versions() -> None:
    o = multi_pool(1, 4)
    assert done(o, o.publish(1)) == []
    assert o.place(["a"], version=1) == "i0"
    assert done(o, o.publish(2)) == []
    assert o.place(["b"], version=2) == "i0"
    assert o.rollback(1, forget=["b"]) == [Unload("i0", 2)]
    assert o.held_versions("i0") == {0, 1}
    assert o.place(["c"], version=1) == "i0"


def test_other_modes_treat_a_multi_version_instance_as_a_single_version_one() -> None:
    o = Orchestrator(mode=Mode.ONE_STEP_OFF)
    [load] = o.add_instance("i0", capacity=2, multi_version=True)
    assert done(o, [load]) == []
    assert o.place(["a"], version=0) == "i0"
    assert o.publish(1) == [Drain("i0")]
