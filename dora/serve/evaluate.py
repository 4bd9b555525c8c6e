"""Evaluation while training: accuracy on held-out tasks, on the newest loaded version.

Which versions. Version `w` is the model after `w` trained steps. Version 0 (the initial model,
after the warm-up) is evaluated as soon as an instance holds it; then, every time the newest
*loaded* version reaches the next multiple of `data.eval_every`, or was trained at or after the
next multiple of `data.eval_every_s` seconds of the run, that version (a version the orchestrator
skips because a newer one was published first is not waited for: the newest loaded one is
evaluated instead); and at the end of the run the final version (`learn.steps`, or the step a
`learn.max_minutes` budget ended at, plus one), which `Rollout` loads for this once every step
is trained, before `Shutdown`. So a run's first and last `eval` records are the before/after
numbers. One evaluation runs at a time; a threshold crossed while one runs starts the next one,
on the newest loaded version, when it ends.

How, without blocking training. The evaluation runs on ordinary leases of one version (at most half
of an instance's capacity, so groups still find room), each a worker that runs held-out episodes one
after another at `data.eval_temperature` (0 by default: the engine samples greedily when
`temperature <= 0`), `data.eval_samples` episodes per task (1 by default), until the tasks are used
up, then ends its lease. At a temperature each held-out episode has its own seed, the same in every
evaluation, so two versions are compared on the same sampling noise. A periodic evaluation takes the
newest loaded version at the moment it finds room: one that waited for a version superseded
meanwhile would wait forever (no instance takes new requests of an old version), and would hold up
every later evaluation and the end of the run. It starts with the room there is and adds leases as
slots free up, up to its share, so an evaluation that starts on busy instances runs as batched as
the first one rather than one episode at a time. The leases are ordinary leases for the orchestrator
and the router: they keep the version loaded while the evaluation runs and may be migrated like any
other (same version, C1); they are not groups, so nothing of an evaluation reaches the transfer
queue or the trainer. With episode runners (`serve.runners`) the held-out episodes run on them, as
the training episodes do (a lost runner's episode runs again from its start); serve's loop keeps
only the leases and the record. In `partial` mode a publish resumes every request on the newest
version, so an evaluation there may finish on a newer version than its record says. In `inflight`
mode an instance that holds evaluation leases (pinned leases, `Router.open`) puts off loading a
newer version until they have ended, so an evaluation is of the one version its record names (the
instance's other requests go on under the old weights meanwhile). The record says how many of the
evaluation's sampled tokens another version sampled (`off_version_tokens`: 0 but in partial mode).
At the end, the running evaluation is waited for (bounded, and logged), no periodic one starts any
more, and the final version is evaluated.

Records (`rollout.jsonl`): `{"kind": "eval", "time_s", "step": w, "version": w, "due", "due_s",
"accuracy", "success_at", "reward_mean", "n", "masked", "concurrency", "version_time_s",
"started_s", "seconds", "off_version_tokens", "temperature", "samples_per_task", "pass_at_k"}`:
`due` and `due_s` are the thresholds (a multiple of `data.eval_every`, of `data.eval_every_s`; null
for the one that did not fall due) the evaluation was started for, `concurrency` the most episodes
it ran at once, `version_time_s` when version `w` was trained (on the clock of `time_s`: seconds
since serve started; 0 for version 0), `started_s` when the evaluation started; `accuracy` is the
success rate: the fraction of held-out episodes whose reward is at least `success_at`
(`data.eval_success_at`, 1.0 by default: the math environments score 1.0 for a right answer), and
`reward_mean` the mean reward of all of them, for tasks whose reward has no such line. With
`samples_per_task` k > 1, `accuracy` is the mean over the k episodes of every task (avg@k) and
`pass_at_k` the share of tasks with at least one success (null with k = 1, where it equals
`accuracy`); `n` counts episodes, k per task. `temperature` is `data.eval_temperature`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from dora.config import DataConfig
from dora.env import Env, Task
from dora.episode import ChatRenderer, EpisodeLimits, run_fresh_episode
from dora.protocol import Sample, SamplingParams
from dora.records import Eval
from dora.serve.metrics import MetricsLog
from dora.serve.placement import Placement
from dora.serve.runners import RunnerHub
from dora.serve.spawn import Spawner

__all__ = ["Evaluator", "held_out_seed"]

log = logging.getLogger("dora.serve")


@dataclass(frozen=True)
class Due:
    """Why an evaluation runs: the multiple of `data.eval_every` (steps) and/or of
    `data.eval_every_s` (seconds of the run) that fell due; None for a reason that did not."""

    steps: int | None = None
    seconds: float | None = None

    def merge(self, later: Due) -> Due:
        """One evaluation for two dues: the earlier threshold of each kind."""
        return Due(
            steps=self.steps if self.steps is not None else later.steps,
            seconds=self.seconds if self.seconds is not None else later.seconds,
        )


class Evaluator:
    """Runs the evaluations of one rollout (see the module docstring)."""

    def __init__(
        self,
        data: DataConfig,
        *,
        max_tokens: int,
        limits: EpisodeLimits,
        max_running: int,
        placement: Placement,
        newest_loaded: Callable[[], int | None],
        trained_at: Callable[[int], float | None],
        metrics: MetricsLog,
        spawn: Spawner,
        tasks: list[Task],
        env_factory: Callable[[], Env],
        renderer: ChatRenderer,
        runners: RunnerHub | None = None,
    ) -> None:
        self._placement = placement
        self._runners = runners
        """Where the episodes run when `serve.runners` is set (else here, in serve's loop)."""
        self._newest_loaded = newest_loaded
        """The transfer queue's newest loaded version."""
        self._trained_at = trained_at
        """When a version was trained, on the clock of the run's records."""
        self._metrics = metrics
        self._spawn = spawn
        self._tasks = tasks
        self._env_factory = env_factory
        self._renderer = renderer
        self._every = data.eval_every
        self._every_s = data.eval_every_s
        self._success_at = data.eval_success_at
        self._params = SamplingParams(
            max_tokens=max_tokens, temperature=data.eval_temperature, top_p=1.0
        )
        self._k = data.eval_samples
        """Episodes per held-out task."""
        self._limits = limits
        self._workers = max(1, min(len(tasks) * self._k, max_running // 2))
        """Leases at once: half an instance's `serve.max_running` at most."""
        self._next_due: float = 0
        """The smallest version the next periodic evaluation waits for (by steps)."""
        self._next_due_s = math.inf if not self._every_s else self._every_s
        """When the version must have been trained for the next evaluation by time."""
        self._running: asyncio.Task[None] | None = None
        self._pending: Due | None = None
        """What fell due while an evaluation ran (it starts when that one ends)."""
        self._finishing = False
        self._count = 0
        self._wake = asyncio.Event()
        self.done: set[int] = set()
        """Versions evaluated (or being evaluated)."""
        self.history: list[tuple[int, float]] = []
        """(version, accuracy) of every evaluation so far, in the order they finished."""

    def wake(self) -> None:
        """A state change that can free room or load a version (called by `Placement.apply`)."""
        self._wake.set()

    def on_loaded(self, version: int) -> None:
        """An instance holds `version` (the newest loaded one): evaluate it if one is due, by
        steps (`data.eval_every`; version 0 always) or by the time it was trained
        (`data.eval_every_s`)."""
        if self._finishing or version in self.done:
            return
        at = self._trained_at(version)
        by_steps = version >= self._next_due
        by_time = at is not None and at >= self._next_due_s
        if not (by_steps or by_time):
            return
        due = Due(
            steps=int(self._next_due) if by_steps else None,
            seconds=self._next_due_s if by_time else None,
        )
        if by_steps:  # without eval_every, version 0 only
            self._next_due = (version // self._every + 1) * self._every if self._every else math.inf
        if by_time:
            assert at is not None
            self._next_due_s = (at // self._every_s + 1) * self._every_s
        if self._running is not None:
            self._pending = due if self._pending is None else self._pending.merge(due)
            return
        self._start(due)

    def _start(self, due: Due) -> None:
        self._running = self._spawn(self._periodic(due), name=f"eval-due{due}")

    async def _periodic(self, due: Due) -> None:
        try:
            await self.evaluate(None, due=due)
        finally:
            self._running = None
        newest = self._newest_loaded()
        if self._pending is not None and not self._finishing:
            due, self._pending = self._pending, None
            if newest is not None and newest not in self.done:
                self._start(due)

    async def finish(self, version: int, *, timeout_s: float) -> None:
        """At the end of the run: wait (bounded) for a running evaluation, then evaluate `version`
        (the final one) unless it was already. `Rollout` has asked the orchestrator to load it."""
        self._finishing = True  # no periodic evaluation starts any more
        self._pending = None
        async with asyncio.timeout(timeout_s):
            while self._running is not None:
                log.info("the run waits for the evaluation that is running before the final one")
                await asyncio.shield(self._running)
            if version not in self.done:
                await self.evaluate(version, due=Due(steps=version))

    async def evaluate(self, version: int | None, *, due: Due) -> Eval:
        """Evaluate `version` (None: the newest loaded one when room is found) on the held-out
        tasks, for the threshold `due`; write and return the `eval` record."""
        started = time.monotonic()
        self._count += 1
        prefix = f"eval{self._count}"
        queue = [
            (i, task, self._episode_params(held_out_seed(i, rep, self._k)))
            for i, task in enumerate(self._tasks)
            for rep in range(self._k)
        ][::-1]
        done: list[tuple[int, Sample]] = []
        version, concurrency = await self._run_workers(version, prefix, queue, done)
        samples = [s for _, s in done]
        n = len(samples)
        success_at = self._success_at
        solved = [i for i, s in done if not s.masked and s.reward >= success_at]
        correct = len(solved)
        trained_at = self._trained_at(version)
        record = Eval(
            step=version,
            version=version,
            due=due.steps,
            due_s=due.seconds,
            accuracy=correct / n if n else 0.0,
            success_at=success_at,
            reward_mean=math.fsum(s.reward for s in samples) / n if n else 0.0,
            n=n,
            masked=sum(1 for s in samples if s.masked),
            concurrency=concurrency,
            version_time_s=None if trained_at is None else round(trained_at, 4),
            started_s=round(started - self._metrics.start, 4),
            seconds=round(time.monotonic() - started, 4),
            off_version_tokens=off_version_share(samples, version),
            temperature=self._params.temperature,
            samples_per_task=self._k,
            pass_at_k=len(set(solved)) / len(self._tasks) if self._k > 1 and self._tasks else None,
        )
        self._metrics.write(record)
        self.history.append((version, record.accuracy))
        log.info(
            "eval: version %d success %.3f (reward >= %g), reward mean %.3f "
            "(%d held-out episodes, %d at once, %.1f s)",
            version,
            record.accuracy,
            success_at,
            record.reward_mean,
            n,
            concurrency,
            record.seconds,
        )
        return record

    async def _run_workers(
        self,
        version: int | None,
        prefix: str,
        queue: list[tuple[int, Task, SamplingParams]],
        samples: list[tuple[int, Sample]],
    ) -> tuple[int, int]:
        """Run the held-out episodes on leases of one version: (that version, the most leases held
        at once). Leases are added as room frees up, up to `_workers`, while the version's
        instances still accept requests: an evaluation that starts on a busy instance grows to its
        share instead of running one episode at a time. With `version` None the evaluation takes
        the newest loaded version at the moment it finds room (a version superseded while it
        waited is never waited for: no instance would take new requests of it)."""
        active: set[str] = set()
        peak = opened = 0
        async with asyncio.TaskGroup() as tg:
            while queue:
                self._wake.clear()
                target = self._newest_loaded() if version is None else version
                want = min(self._workers - len(active), len(queue))
                n = self._room(target, want) if target is not None else 0
                if n:
                    assert target is not None
                    version = target
                    self.done.add(version)
                    leases = [f"{prefix}/{opened + i}" for i in range(n)]
                    opened += n
                    self._placement.place(leases, version=version, pinned=True)
                    for lid in leases:
                        active.add(lid)
                        tg.create_task(self._worker(lid, queue, samples, active))
                    peak = max(peak, len(active))
                    continue
                await self._wake.wait()
        assert version is not None, "an evaluation with tasks places at least one lease"
        return version, peak

    def _room(self, version: int, want: int) -> int:
        """How many of `want` new leases one accepting instance of `version` has room for."""
        for n in range(want, 0, -1):
            if self._placement.can_place(n, version=version) is not None:
                return n
        return 0

    async def _worker(
        self,
        lease_id: str,
        queue: list[tuple[int, Task, SamplingParams]],
        samples: list[tuple[int, Sample]],
        active: set[str],
    ) -> None:
        """Run queued (task index, task, params) episodes on one lease; append (index, sample)."""
        try:
            while queue:
                index, task, params = queue.pop()
                samples.append((index, await self._episode(lease_id, task, params)))
        finally:
            active.discard(lease_id)
            self._wake.set()
            # a roll-back may have forgotten it (partial mode, ghost version)
            self._placement.end(lease_id, forgotten_ok=True)

    def _episode_params(self, seed: int) -> SamplingParams:
        """Sampling of one held-out episode: at a temperature, seeded with `seed`
        (`held_out_seed`), so every version draws the same noise for the same episode and the
        before/after difference is not blurred by fresh sampling noise."""
        if self._params.temperature <= 0:
            return self._params
        return msgspec.structs.replace(self._params, seed=seed)

    async def _episode(self, lease_id: str, task: Task, params: SamplingParams) -> Sample:
        if self._runners is not None:
            return await self._runners.run_episode(lease_id, task, params)
        return await run_fresh_episode(
            sampler=self._placement.sampler(lease_id),
            task=task,
            env_factory=self._env_factory,
            renderer=self._renderer,
            params=params,
            limits=self._limits,
        )


def held_out_seed(task_index: int, repeat: int, samples_per_task: int) -> int:
    """The sampling seed of repeat `repeat` of held-out task `task_index` in every evaluation
    (and in `dora bench trl`'s, so both trainers are evaluated on the same noise)."""
    return task_index * samples_per_task + repeat


def off_version_share(samples: list[Sample], version: int) -> float:
    """The share of the samples' sampled tokens that a version other than `version` sampled."""
    sampled = [s.sampled_versions() for s in samples]
    total = sum(len(v) for v in sampled)
    off = sum(int((v != version).sum()) for v in sampled)
    return round(off / total, 6) if total else 0.0
