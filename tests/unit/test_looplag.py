"""The loop-stall watchdog names the task that holds the event loop, and where it is."""

from __future__ import annotations

import asyncio
import time

import pytest

from dora.looplag import LoopProbe, StallWatch


async def _a_blocking_hook() -> None:
    await asyncio.sleep(0.05)
    time.sleep(1.0)  # noqa: ASYNC251  (an async hook that blocks the loop: the case watched for)


async def test_the_stall_watch_names_the_task_that_held_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = StallWatch(after_s=0.3)
    probe = asyncio.create_task(LoopProbe(0.01, watch=watch).run())
    await asyncio.sleep(0.05)
    await asyncio.create_task(_a_blocking_hook(), name="episode-7")
    await asyncio.sleep(0.05)
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    [stall] = watch.stalls
    assert "task 'episode-7' (_a_blocking_hook)" in stall, stall
    assert "test_looplag.py" in stall and "_a_blocking_hook" in stall, stall
    assert "held for" in caplog.text and "episode-7" in caplog.text


async def test_a_loop_that_runs_freely_is_never_reported() -> None:
    watch = StallWatch(after_s=0.5)
    probe = asyncio.create_task(LoopProbe(0.01, watch=watch).run())
    for _ in range(20):
        await asyncio.sleep(0.02)
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert watch.stalls == []
