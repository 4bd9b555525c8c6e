"""The orchestration clock: every call through a stand-in is timed, in total and per method."""

from __future__ import annotations

import time

import pytest

from dora.serve.coretime import CoreClock


class Queue:
    def __init__(self) -> None:
        self.size = 3

    def slow(self) -> int:
        time.sleep(0.02)
        return 1

    def fast(self, x: int) -> int:
        return x + 1


class Orchestrator:
    def slow(self) -> None:
        time.sleep(0.01)


def test_calls_are_timed_in_total_and_by_type_and_method() -> None:
    clock = CoreClock()
    queue, orch = clock.wrap(Queue()), clock.wrap(Orchestrator())
    assert queue.slow() == 1 and queue.fast(1) == 2 and queue.size == 3
    orch.slow()
    queue.slow()
    assert clock.calls == 4
    assert set(clock.by_call) == {"Queue.slow", "Queue.fast", "Orchestrator.slow"}
    assert clock.by_call["Queue.slow"] >= 0.04
    assert clock.by_call["Orchestrator.slow"] >= 0.01
    assert abs(sum(clock.by_call.values()) - clock.seconds) < 1e-9


def test_a_call_that_raises_is_timed_too() -> None:
    class Failing:
        def boom(self) -> None:
            time.sleep(0.01)
            raise ValueError("no")

    clock = CoreClock()
    failing = clock.wrap(Failing())
    with pytest.raises(ValueError):
        failing.boom()
    assert clock.calls == 1 and clock.by_call["Failing.boom"] >= 0.01
