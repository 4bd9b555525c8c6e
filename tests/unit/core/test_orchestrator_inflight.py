"""Mode `inflight`: on a new version every instance loads it under its running requests, which
go on there (no park, no resume) and whose leases move to the new version; the instance takes new
requests once the load is done."""

from __future__ import annotations

from dora.core.orchestrator import Load, Mode, Orchestrator
from tests.unit.core.test_orchestrator import loaded, shape


def pool(n: int, capacity: int) -> Orchestrator:
    o = Orchestrator(mode=Mode.INFLIGHT)
    for i in range(n):
        assert shape(o.add_instance(f"i{i}", capacity=capacity)) == [Load(f"i{i}", 0)]
        assert loaded(o, f"i{i}", 0) == []
    return o


def test_inflight_loads_under_running_requests_without_parking_them() -> None:
    o = pool(2, 3)
    assert o.place(["a", "b"], version=0) == "i0"
    assert o.place(["c"], version=0) == "i1"
    # every instance loads version 1 at once, its requests still on it: no Park, no Resume
    assert shape(o.publish(1)) == [Load("i0", 1), Load("i1", 1)]
    assert (o.location("a"), o.location("b"), o.location("c")) == ("i0", "i0", "i1")
    assert o.live() == {1: 3}  # the leases follow the version that samples from now on
    assert o.request_version("a") == 1
    # no new request of version 1 before a load is done, then it goes where there is room
    assert o.place(["d"], version=1) is None
    assert loaded(o, "i0", 1) == []
    assert loaded(o, "i1", 1) == []
    assert o.place(["d", "e"], version=1) == "i1"
    o.finish("a")
    assert o.live() == {1: 4}


def test_inflight_empty_instances_load_too_and_a_publish_during_a_load_retargets() -> None:
    o = pool(2, 2)
    o.place(["a"], version=0)
    assert shape(o.publish(1)) == [Load("i0", 1), Load("i1", 1)]
    # version 2 before version 1 is in: each instance is told to load 2 instead
    assert shape(o.publish(2)) == [Load("i0", 2), Load("i1", 2)]
    assert o.pending_load("i0") is not None and o.pending_load("i0").version == 2  # type: ignore[union-attr]
    assert loaded(o, "i0", 2) == [] and loaded(o, "i1", 2) == []
    assert o.request_version("a") == 2 and o.location("a") == "i0"


def test_inflight_parked_requests_resume_on_the_newest_version() -> None:
    o = pool(2, 2)
    o.place(["a"], version=0)
    o.publish(1)
    loaded(o, "i0", 1)
    loaded(o, "i1", 1)
    actions = o.remove_instance("i0")  # a's instance died: it moves to the other one
    assert o.location("a") == "i1" and o.request_version("a") == 1, actions
