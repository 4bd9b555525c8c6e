"""CPU priority by deadline: which instances keep the normal policy, and the engines told their
role as the oldest version in flight moves (the engine side: tests/unit/engine/test_worker_turns.py;
through serve: tests/integration/bench/test_report_and_bench_cli.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dora.serve import cpu_priority
from dora.serve.cpu_priority import CpuPriority, foreground

VERSIONS = st.dictionaries(st.integers(0, 6), st.integers(1, 3), max_size=3)


@given(st.dictionaries(st.sampled_from("abcdef"), VERSIONS, min_size=1))
def test_the_oldest_version_in_flight_and_idle_instances_keep_the_cores(
    inflight: dict[str, dict[int, int]],
) -> None:
    normal = foreground(inflight)
    busy = [v for versions in inflight.values() for v in versions]
    for instance, versions in inflight.items():
        expected = not versions or min(busy) in versions
        assert (instance in normal) == expected, (instance, inflight)
    if busy:  # some instance with a call in flight always keeps the cores
        assert any(inflight[i] for i in normal)


def test_one_version_in_flight_leaves_every_instance_alone() -> None:
    assert foreground({"i0": {3: 2}, "i1": {3: 1}, "i2": {}}) == {"i0", "i1", "i2"}
    assert foreground({"i0": {3: 2, 4: 1}, "i1": {4: 5}, "i2": {5: 1}}) == {"i0"}


class Engine:
    """An engine's role as serve sets it (`CpuPriority` calls it as it calls an engine's
    `/control/priority`)."""

    def __init__(self, *, fails: bool = False, hangs: bool = False) -> None:
        self.background = False
        self.calls = 0
        self.fails = fails
        self.hangs = hangs

    async def __call__(self, background: bool) -> None:
        self.calls += 1
        if self.fails:
            raise ConnectionError("the instance is gone")
        if self.hangs:
            await asyncio.Event().wait()
        self.background = background


async def test_engines_follow_the_oldest_version_in_flight() -> None:
    a, b = Engine(), Engine()
    priority = CpuPriority()
    await priority.apply([("i0", a, {3: 1}), ("i1", b, {4: 2}), ("vllm", None, {5: 1})])
    assert (a.background, b.background) == (False, True)
    assert (a.calls, b.calls, priority.switches) == (0, 1, 1)  # the normal role is the default
    await priority.apply([("i0", a, {3: 1}), ("i1", b, {4: 1})])  # unchanged: no call
    assert (a.calls, b.calls) == (0, 1)
    await priority.apply([("i0", a, {5: 1}), ("i1", b, {4: 1})])  # i0's old call ended
    assert (a.background, b.background) == (True, False)
    await priority.apply([("i0", a, {}), ("i1", b, {4: 1})])  # an idle instance keeps the cores
    assert (a.background, b.background) == (False, False)
    assert priority.switches == 4


async def test_an_engine_that_does_not_answer_is_asked_again() -> None:
    a, gone = Engine(), Engine(fails=True)
    priority = CpuPriority()
    await priority.apply([("i0", a, {3: 1}), ("i1", gone, {4: 1})])
    await priority.apply([("i0", a, {3: 1}), ("i1", gone, {4: 1})])
    assert gone.calls == 2 and priority.switches == 0
    await priority.apply([("i0", a, {5: 1}), ("i1", gone, {4: 1})])  # the others still move
    assert a.background and priority.switches == 1


async def test_a_hung_engine_delays_the_others_by_the_call_timeout_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_priority, "CALL_TIMEOUT_S", 0.05)
    hung, other = Engine(hangs=True), Engine()
    priority = CpuPriority()
    started = time.perf_counter()
    await priority.apply([("i0", Engine(), {4: 1}), ("i1", hung, {5: 1}), ("i2", other, {6: 1})])
    assert time.perf_counter() - started < 1.0
    assert other.background and priority.switches == 1
    assert hung.calls == 1 and not hung.background  # asked again next time
