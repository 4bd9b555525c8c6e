"""The health deadline against fake instances: a hung or unreachable one is reported, naming
what failed; one that answers is never reported."""

from __future__ import annotations

import asyncio
import itertools
import statistics

import pytest

from dora.errors import ServerUnavailable
from dora.serve.health import HealthWatch

pytestmark = pytest.mark.timeout(10)


class Probe:
    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def health(self, *, timeout_s: float = 5.0) -> dict[str, object]:
        if self.mode == "hung":
            await asyncio.sleep(3600)  # a client without a deadline of its own
        if self.mode == "gone":
            raise ServerUnavailable("health: http://127.0.0.1:9 unreachable")
        return {"status": "ok"}


async def test_hung_and_unreachable_instances_are_reported_within_the_deadline() -> None:
    clients = {"ok": Probe("ok"), "hung": Probe("hung"), "gone": Probe("gone")}
    dead: dict[str, str] = {}
    both = asyncio.Event()

    def on_dead(instance: str, error: str) -> None:
        dead[instance] = error
        if len(dead) == 2:
            both.set()

    watch = HealthWatch(
        targets=lambda: {i: c for i, c in clients.items() if i not in dead},  # type: ignore[misc]
        on_dead=on_dead,
        timeout_s=0.4,
    )
    task = asyncio.ensure_future(watch.run())
    try:
        await both.wait()
        await asyncio.sleep(0.5)  # a few more rounds: the healthy one stays alive
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert set(dead) == {"hung", "gone"}
    assert "unreachable" in dead["gone"] and "within 0.4 s" in dead["hung"]
    assert watch.failures == 2 and watch.probes > 4


class Clock:
    """A healthy instance that records when it was probed."""

    def __init__(self, times: list[float]) -> None:
        self.times = times

    async def health(self, *, timeout_s: float = 5.0) -> dict[str, object]:
        self.times.append(asyncio.get_running_loop().time())
        return {"status": "ok"}


async def test_a_round_of_probes_is_spread_over_the_interval_not_sent_at_once() -> None:
    """Probing 128 instances in one loop iteration stalls the loop for that iteration; spread
    over the interval, each iteration sends one or two probes."""
    n = 16
    times: list[list[float]] = [[] for _ in range(n)]
    clients = {f"i{k}": Clock(times[k]) for k in range(n)}
    watch = HealthWatch(targets=lambda: clients, on_dead=lambda i, e: None, timeout_s=0.8)
    start = asyncio.get_running_loop().time()
    task = asyncio.ensure_future(watch.run())
    try:
        await asyncio.sleep(2.5 * watch.every_s)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    firsts = sorted(t[0] - start for t in times)
    assert all(t for t in times), "every instance probed"
    # Medians, not extremes: on a loaded machine a stalled loop wakes several due timers at once,
    # which says nothing about when they were due. A round sent at once has a median gap of 0.
    gaps = [b - a for a, b in itertools.pairwise(firsts)]
    assert statistics.median(gaps) > 0.5 * watch.every_s / n, f"spread over the interval: {gaps}"
    assert firsts[-1] <= watch.every_s * 1.5, "the last within about one interval"
    for probed in times:  # each instance still probed about every interval
        intervals = [b - a for a, b in itertools.pairwise(probed)]
        assert 0.8 * watch.every_s < statistics.median(intervals) < 1.5 * watch.every_s, intervals


async def test_an_instance_that_answered_a_call_within_the_interval_is_not_probed() -> None:
    """A model call's answer shows what a probe would (the process and its model run): only the
    silent instance is probed, and it is still declared dead when it stops answering."""
    probed: list[float] = []
    clients = {"calls": Clock([]), "silent": Clock(probed)}
    loop = asyncio.get_running_loop()
    answered = {"calls": loop.time(), "silent": float("-inf")}

    async def answering() -> None:  # a call answered from "calls" every 50 ms
        while True:
            answered["calls"] = loop.time()
            await asyncio.sleep(0.05)

    watch = HealthWatch(
        targets=lambda: clients,  # type: ignore[arg-type,return-value]
        on_dead=lambda i, e: None,
        timeout_s=0.4,
        answered_at=answered.__getitem__,
    )
    tasks = [asyncio.ensure_future(answering()), asyncio.ensure_future(watch.run())]
    try:
        await asyncio.sleep(4.5 * watch.every_s)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert clients["calls"].times == [] and watch.skipped >= 3
    assert len(probed) >= 3 and watch.probes == len(probed)
