"""The health deadline of the instances: one that does not answer a probe in time is dead.

A killed engine is noticed by the first call that finds it unreachable; a hung one (stopped,
deadlocked, swapping) is not: its calls just wait, up to `serve.request_timeout_s`, which has to
be as long as the longest LLM call. `HealthWatch` probes every instance's `/health` every
`timeout_s / 4` seconds (a round's probes spread over that interval), each probe bounded by
`timeout_s` (`serve.health_timeout_s`); an instance whose probe fails or times out is handed to
`on_dead`, and the rollout treats it exactly like a dead one (`InstanceLifecycle.unresponsive`):
its requests move to another instance of their version, the calls it was running are cut and
resubmitted with the tokens their episodes hold, and it is replaced. A hung instance then costs
seconds, not the run.

The probe is cheap on purpose: the engine answers `/health` on its event loop, which never waits
on the model (the model runs on the engine thread), so a busy instance answers at once and only a
stalled process misses the deadline. The answer still tells whether the model runs: the engine
answers 503 while paused or while its engine thread is stuck in one step (its loads excepted),
and a 503 fails the probe like no answer. Serve never pauses an engine, so a paused one was paused
by someone else and is declared unresponsive like a hung one.

An instance that answered a model call within the last interval is not probed that round: the
answer showed what the probe would (the process runs, and so does its model, which produced it),
and a busy cluster's calls outnumber its probes, so a probe of an instance that just answered
costs serve's loop work and says nothing new. An instance that stops answering is probed from the
next round on, so a hang is noticed at most one interval later than with a probe every round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from dora.errors import ProtocolError, ServerError
from dora.serve.instances import InstanceClient

__all__ = ["HealthWatch"]

log = logging.getLogger("dora.serve")


class HealthWatch:
    """Probe `targets()` (instance id -> client) until cancelled; report failures to `on_dead`
    (instance id, what failed), once per instance."""

    def __init__(
        self,
        *,
        targets: Callable[[], Mapping[str, InstanceClient]],
        on_dead: Callable[[str, str], None],
        timeout_s: float,
        answered_at: Callable[[str], float] | None = None,
    ) -> None:
        """`answered_at(instance)`: the loop time of the last model call it answered (module
        doc); without it, every instance is probed every round."""
        self.timeout_s = timeout_s
        self.every_s = timeout_s / 4
        self._targets = targets
        self._on_dead = on_dead
        self._answered_at = answered_at
        self.probes = 0
        self.skipped = 0
        """Probes not sent: the instance had answered a call within the interval."""
        self.failures = 0

    async def run(self) -> None:
        while True:
            targets = list(self._targets().items())
            if not targets:
                await asyncio.sleep(self.every_s)
                continue
            # Spread over the interval: a round sent at once is one HTTP call per instance in a
            # single loop iteration, which stalls the loop for as long as a hundred calls take.
            async with asyncio.TaskGroup() as tg:
                for k, (instance, client) in enumerate(targets):
                    after_s = self.every_s * (k + 1) / len(targets)
                    tg.create_task(
                        self._probe(instance, client, after_s), name=f"health-{instance}"
                    )

    async def _probe(self, instance: str, client: InstanceClient, after_s: float) -> None:
        await asyncio.sleep(after_s)
        if self._targets().get(instance) is not client:
            return  # stopped or replaced since the round began: not ours to judge any more
        answered_at = float("-inf") if self._answered_at is None else self._answered_at(instance)
        if asyncio.get_running_loop().time() - answered_at < self.every_s:
            self.skipped += 1
            return
        self.probes += 1
        try:
            # The client's own deadline; the outer one also bounds a client that has none.
            async with asyncio.timeout(self.timeout_s + 1.0):
                await client.health(timeout_s=self.timeout_s)
        except (ServerError, ProtocolError, TimeoutError) as exc:
            self.failures += 1
            what = str(exc) or f"no answer within {self.timeout_s:g} s"
            log.warning("instance %s failed its health probe: %s", instance, what)
            self._on_dead(instance, what)
