"""The health deadline against fake instances: a hung or unreachable one is reported, naming
what failed; one that answers is never reported."""

from __future__ import annotations

import asyncio

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
