"""Evaluation while training: greedy accuracy on held-out tasks, on the newest loaded version.

Which versions. Version `w` is the model after `w` trained steps. Version 0 (the initial model,
after the warm-up) is evaluated as soon as an instance holds it; then, every time the newest
*loaded* version reaches the next multiple of `data.eval_every`, that version (a version the
orchestrator skips because a newer one was published first is not waited for: the newest loaded
one is evaluated instead); and at the end of the run the final version (`learn.steps`), which
`Rollout` loads for this once every step is trained, before `Shutdown`. So a run's first and
last `eval` records are the before/after numbers. One evaluation runs at a time; a threshold
crossed while one runs starts the next one, on the newest loaded version, when it ends.

How, without blocking training. The evaluation takes `n` leases on the version (at most half of
an instance's capacity, so groups still find room), on one instance that has room; each lease
is a worker that runs held-out episodes one after another at temperature 0 (the engine samples
greedily when `temperature <= 0`) until the tasks are used up, then ends its lease. The leases
are ordinary leases for the orchestrator and the router: they keep the version loaded while the
evaluation runs and may be migrated like any other (same version, C1); they are not groups, so
nothing of an evaluation reaches the transfer queue or the trainer. In `partial` mode a publish
resumes every request on the newest version, so an evaluation there may finish on a newer version
than its record says.

Records (`rollout.jsonl`): `{"kind": "eval", "step": w, "version": w, "accuracy", "reward_mean",
"n", "masked", "seconds"}`; `accuracy` is the fraction of held-out episodes whose reward is at
least `CORRECT_AT` (the math environments score 1.0 for a right answer).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dora.env import Env, Task
from dora.errors import SchedulingError
from dora.protocol import Sample, SamplingParams
from dora.serve.dispatcher import episode_limits, episode_on_lease, turn_max_tokens
from dora.serve.episode import ChatRenderer

if TYPE_CHECKING:
    from dora.serve.rollout import Rollout

__all__ = ["CORRECT_AT", "Evaluator"]

log = logging.getLogger("dora.serve")

CORRECT_AT = 1.0
"""A held-out episode counts as correct when its reward is at least this."""


class Evaluator:
    """Runs the evaluations of one rollout (see the module docstring)."""

    def __init__(
        self,
        rollout: Rollout,
        *,
        tasks: list[Task],
        env_factory: Callable[[], Env],
        renderer: ChatRenderer,
    ) -> None:
        cfg = rollout.config
        self._r = rollout
        self._tasks = tasks
        self._env_factory = env_factory
        self._renderer = renderer
        self._every = cfg.data.eval_every
        self._params = SamplingParams(max_tokens=turn_max_tokens(cfg), temperature=0.0, top_p=1.0)
        self._limits = episode_limits(cfg)
        self._workers = max(1, min(len(tasks), cfg.serve.max_running // 2))
        self._next_due = 0
        """The smallest version the next periodic evaluation waits for."""
        self._running: asyncio.Task[None] | None = None
        self._pending = False
        self._count = 0
        self._wake = asyncio.Event()
        self.done: set[int] = set()
        """Versions evaluated (or being evaluated)."""
        self.history: list[tuple[int, float]] = []
        """(version, accuracy) of every evaluation so far, in the order they finished."""

    def wake(self) -> None:
        """A state change that can free room or load a version (called by `Rollout.apply`)."""
        self._wake.set()

    def on_loaded(self, version: int) -> None:
        """An instance holds `version` (the newest loaded one): evaluate it if one is due."""
        if version < self._next_due or version in self.done:
            return
        self._next_due = (version // self._every + 1) * self._every
        if self._running is not None:
            self._pending = True
            return
        self._start(version)

    def _start(self, version: int) -> None:
        self.done.add(version)
        self._running = self._r.spawn(self._periodic(version), name=f"eval-v{version}")

    async def _periodic(self, version: int) -> None:
        try:
            await self.evaluate(version)
        finally:
            self._running = None
        newest = self._r.queue.newest_version
        if self._pending and newest is not None and newest not in self.done:
            self._pending = False
            self._start(newest)

    async def finish(self, version: int, *, timeout_s: float) -> None:
        """At the end of the run: wait for a running evaluation, then evaluate `version` (the
        final one) unless it was already. `Rollout` has asked the orchestrator to load it."""
        while self._running is not None:  # one may start the next (a threshold crossed meanwhile)
            await asyncio.shield(self._running)
        if version in self.done:
            return
        self.done.add(version)
        await self.evaluate(version, timeout_s=timeout_s)

    async def evaluate(self, version: int, *, timeout_s: float | None = None) -> dict[str, object]:
        """Evaluate `version` on the held-out tasks; write and return the `eval` record."""
        r = self._r
        started = time.monotonic()
        self._count += 1
        leases = await self._place(version, f"eval{self._count}", timeout_s=timeout_s)
        queue = list(reversed(self._tasks))
        samples: list[Sample] = []
        async with asyncio.TaskGroup() as tg:
            for lid in leases:
                tg.create_task(self._worker(lid, queue, samples))
        n = len(samples)
        correct = sum(1 for s in samples if not s.masked and s.reward >= CORRECT_AT)
        record: dict[str, object] = {
            "step": version,
            "version": version,
            "accuracy": correct / n if n else 0.0,
            "reward_mean": math.fsum(s.reward for s in samples) / n if n else 0.0,
            "n": n,
            "masked": sum(1 for s in samples if s.masked),
            "seconds": round(time.monotonic() - started, 4),
        }
        r.metrics.write("eval", record)
        self.history.append((version, correct / n if n else 0.0))
        log.info(
            "eval: version %d accuracy %.3f (%d held-out tasks, %.1f s)",
            version,
            record["accuracy"],
            n,
            record["seconds"],
        )
        return record

    async def _place(self, version: int, prefix: str, *, timeout_s: float | None) -> list[str]:
        """Leases for the workers, on one instance of `version` with room (waits for room)."""
        r = self._r
        async with asyncio.timeout(timeout_s):
            while True:
                self._wake.clear()
                for n in range(self._workers, 0, -1):
                    if r.orchestrator.can_place(n, version=version) is None:
                        continue
                    leases = [f"{prefix}/{i}" for i in range(n)]
                    where = r.orchestrator.place(leases, version=version)
                    assert where is not None, "can_place said there was room"
                    for lid in leases:
                        r.router.open(lid, version=version, instance=where)
                    return leases
                await self._wake.wait()

    async def _worker(self, lease_id: str, queue: list[Task], samples: list[Sample]) -> None:
        r = self._r
        try:
            while queue:
                task = queue.pop()
                samples.append(await self._episode(lease_id, task))
        finally:
            if r.router.close(lease_id):
                try:
                    actions = r.orchestrator.finish(lease_id)
                except SchedulingError:
                    actions = []  # a roll-back forgot it (partial mode, ghost version)
                current = asyncio.current_task()
                if current is None or not current.cancelling():
                    r.apply(actions)

    async def _episode(self, lease_id: str, task: Task) -> Sample:
        return await episode_on_lease(
            self._r,
            lease_id,
            task,
            env_factory=self._env_factory,
            renderer=self._renderer,
            params=self._params,
            limits=self._limits,
        )
