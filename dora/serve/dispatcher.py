"""The dispatcher: dataset -> groups -> G episodes each, admitted through the transfer queue.

Admission binds late (docs/scheduling.md, "Admission"): a group is admitted only at the
newest version published to the orchestrator, once an instance holds it (while it loads, admission
waits), when the transfer queue allows one more group *and* an instance holding that version has
room for all `G` samples. While admissible groups wait for such an instance, the dispatcher reports
the samples of every group the gate would admit as the orchestrator's demand (`set_demand`,
`TransferQueue.admissible`; 0 while the queue is what blocks), so old versions are consolidated
only when the newest version needs the room, and a new version gets all the instances its
groups need in one plan rather than one per weight load. A group is placed
on the least loaded such instance (by the orchestrator), started at once, and its `G` episodes run
concurrently, each with a `LeaseSampler` pinned to the group's version (or, with
`serve.runners`, each on an episode runner process that asks serve's router for every call's
route: `runners.py`). When admission is refused
the dispatcher waits on the placement's `changed` event (set by every completion, lease end, version
load and trainer ack), and the time spent waiting is added up per reason (`weights_not_loaded`,
`invariant`, `no_capacity`, ...).

Why episodes run here and not through `episode.run_group`: each episode's lease must end when
*that* episode ends (a lease lasts from its first token to its end), so the slot it held goes to
the orchestrator while its group's long tail is still running. `run_group` returns only when all
`G` are done, which would hold `G - 1` idle slots per long-tailed group. The group policy is the
same: `mask` keeps masked samples in the group (C2); `retry` regenerates the whole group at its
version through `TransferQueue.fail`, at most `max_retries` times, while an instance of that
version has room, and masks it otherwise.

The prompt stream is `PromptStream` (cycles, reshuffled each epoch) over the tasks that
`dora.data.load_tasks` reads from `data.source`; each admitted group's stream position is
journaled. A `dora serve` restored from its journal continues the stream where it stopped, and
restarts the groups whose episodes died with the previous process (same id, same task) at the
newest version, before it admits new groups (`TransferQueue.restart`), once the trainer has said
hello and serve rolled back to it. The dispatcher keeps that list; the running groups' tasks are
in `RunningGroups`, where a roll-back stops those it removes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from dora.config import DoraConfig, RolloutConfig
from dora.core.orchestrator import Orchestrator
from dora.core.transfer_queue import Admitted, GroupState, RefusalReason
from dora.env import Env, PromptStream, Task
from dora.episode import ChatRenderer, EpisodeLimits, run_fresh_episode
from dora.errors import ServerTimeout
from dora.protocol import Group, Sample, SamplingParams
from dora.serve.journal import JournaledQueue, Restored
from dora.serve.placement import Placement
from dora.serve.runners import RunnerHub
from dora.serve.running import RunningGroups, group_leases
from dora.serve.spawn import Spawner
from dora.serve.stats import ServeStats
from dora.serve.trainer_link import TrainerLink
from dora.serve.turns import Turns

__all__ = ["Dispatcher", "episode_limits"]

log = logging.getLogger("dora.serve")


class Dispatcher:
    """Admits groups and runs their episodes (see the module docstring)."""

    def __init__(
        self,
        rollout: RolloutConfig,
        *,
        limits: EpisodeLimits,
        trainer_timeout_s: float,
        queue: JournaledQueue,
        placement: Placement,
        orchestrator: Orchestrator,
        turns: Turns,
        trainer: TrainerLink,
        restored: Restored,
        running: RunningGroups,
        stats: ServeStats,
        spawn: Spawner,
        tasks: PromptStream,
        env_factory: Callable[[], Env],
        renderer: ChatRenderer,
        runners: RunnerHub | None = None,
    ) -> None:
        self._queue = queue
        self._runners = runners
        """Where the episodes run when `serve.runners` is set (else here, in serve's loop)."""
        self._placement = placement
        self._orchestrator = orchestrator
        self._turns = turns
        self._trainer = trainer
        self._stats = stats
        self._spawn = spawn
        self._group_size = rollout.group_size
        self._tasks = tasks
        self._env_factory = env_factory
        self._renderer = renderer
        self._params = SamplingParams(
            max_tokens=turn_max_tokens(rollout),
            temperature=rollout.temperature,
            top_p=rollout.top_p,
        )
        self._limits = limits
        self._on_error = rollout.on_env_error
        self._trainer_timeout_s = trainer_timeout_s
        """How long admission waits for the trainer's weights (`serve.request_timeout_s`)."""
        self._running = running
        self._lost = list(restored.lost)
        """Groups lost with a previous serve, to restart (the trainer's roll-back first)."""
        self._next = restored.next_group
        self._positions = restored.task_positions
        if restored.starts:
            self._tasks.position = restored.prompt_position

    async def run(self) -> None:
        p, q, g, orch = self._placement, self._queue, self._group_size, self._orchestrator
        # No exit when every step is filled: a trainer restart may roll the queue back. The run
        # ends when the rollout's task group does.
        while True:
            p.changed.clear()
            version = orch.newest
            if self._restart_lost(version):
                continue
            reason = q.admission_blocker(version)
            if reason is None and p.can_place(g, version=version) is None:
                reason = RefusalReason.NO_CAPACITY
            if reason is not None:
                waiting = reason in (RefusalReason.NO_CAPACITY, RefusalReason.WEIGHTS_NOT_LOADED)
                demand = g * q.admissible(version) if waiting else 0
                if orch.demand != demand:
                    p.apply(orch.set_demand(demand))
                await self._wait(reason)
                continue
            gid = f"g{self._next}"
            self._next += 1
            admitted = q.try_admit(gid, version=version)
            assert isinstance(admitted, Admitted) and admitted.version == version
            q.task(gid, self._tasks.position)
            task = self._tasks.next()
            self._start(gid, task, version)
            # Let the group's episodes start before the next admission: a step's burst of
            # hundreds of groups then never holds the loop for seconds (timers, the link).
            await asyncio.sleep(0)

    def _restart_lost(self, version: int) -> bool:
        """Restart one group lost with a previous `dora serve`, at `version` (the newest), if an
        instance has room; True if one was restarted."""
        q = self._queue
        for gid in self._lost_groups():
            if q.group_version(gid) > version or q.admission_blocker(version) in (
                RefusalReason.WEIGHTS_NOT_LOADED,
                RefusalReason.NOT_NEWEST,
            ):
                return False  # the trainer's version is not loaded yet
            if self._placement.can_place(self._group_size, version=version) is None:
                return False
            position = self._positions.get(gid)
            if position is None:  # admitted, but its task was not journaled: a fresh one
                position = self._tasks.position
                self._tasks.next()
            task = PromptStream(
                self._tasks.tasks,
                seed=self._tasks.seed,
                shuffle=self._tasks.shuffle,
                position=position,
            ).next()
            log.info("restarting group %s (lost with the previous serve) at v%d", gid, version)
            self._lost.remove(gid)
            self._trainer.assigned(q.restart(gid, version=version))
            self._start(gid, task, version)
            return True
        return False

    def _lost_groups(self) -> list[str]:
        """Groups of a previous serve to restart now: none until the trainer said hello (its
        roll-back removes the ghosts among them); then those the queue still holds unassigned
        and not kept complete."""
        if not self._trainer.lost_ready.is_set():
            return []
        q = self._queue
        self._lost = [
            gid
            for gid in self._lost
            if q.state(gid) in (GroupState.ADMITTED, GroupState.STARTED)
            or (q.state(gid) is GroupState.COMPLETED and not self._trainer.holds(gid))
        ]
        return self._lost

    async def _wait(self, reason: RefusalReason) -> None:
        """Wait for a state change; only a wait for the trainer's weights has a deadline (it is
        the one that needs another process to make progress)."""
        q, orch, changed = self._queue, self._orchestrator, self._placement.changed
        q.record_admission_wait(reason)
        started = time.monotonic()
        # In that order, so that the common waits never list the instances (hundreds of them)
        deadline = (
            reason is RefusalReason.WEIGHTS_NOT_LOADED
            and not orch.live()
            and not any(v.version == orch.newest and not v.ready for v in orch.instances())
        )
        try:
            if deadline:
                async with asyncio.timeout(self._trainer_timeout_s):
                    await changed.wait()
            else:
                await changed.wait()
        except TimeoutError:
            raise ServerTimeout(
                f"waited {self._trainer_timeout_s:g} s for version "
                f"{q.step - q.max_staleness} from the trainer (step {q.step}, "
                f"newest loaded {q.newest_version}); is dora learn running?"
            ) from None
        finally:
            self._stats.admission_wait_s[reason.value] += time.monotonic() - started

    def _start(self, gid: str, task: Task, version: int) -> None:
        self._place(gid, version)
        self._running.started(
            gid, self._spawn(self._run_group(gid, task, version), name=f"group-{gid}")
        )

    def _place(self, gid: str, version: int) -> None:
        self._placement.place(group_leases(gid, self._group_size), version=version)
        self._queue.start(gid)

    async def _run_group(self, gid: str, task: Task, version: int) -> None:
        try:
            await self._run_group_once(gid, task, version)
        finally:
            self._running.ended(gid)

    async def _run_group_once(self, gid: str, task: Task, version: int) -> None:
        q, trainer = self._queue, self._trainer
        leases = group_leases(gid, self._group_size)
        while True:
            async with asyncio.TaskGroup() as tg:
                running = [tg.create_task(self._episode(lid, task)) for lid in leases]
            samples = [t.result() for t in running]
            await self._turns.take()  # packing and journaling the group
            if self._on_error == "retry" and any(s.masked for s in samples):
                room = self._placement.can_place(self._group_size, version=version) is not None
                outcome = q.fail(gid, retry_allowed=room)
                if outcome.retried:
                    log.info("group %s failed; retrying at version %d", gid, version)
                    self._place(gid, version)
                    continue
                group = self._group(gid, task, version, samples)
                trainer.group_done(group, list(outcome.assigned))
                return
            group = self._group(gid, task, version, samples)
            trainer.group_done(group, q.complete(gid))
            return

    def _group(self, gid: str, task: Task, version: int, samples: list[Sample]) -> Group:
        group = Group(
            id=gid,
            prompt_id=task.prompt_id,
            version=version,
            samples=samples,
            incarnation=self._queue.incarnation,
        )
        self._queue.keep(group)  # journaled before the queue hears it is complete
        return group

    async def _episode(self, lease_id: str, task: Task) -> Sample:
        try:
            if self._runners is not None:
                return await self._runners.run_episode(lease_id, task, self._params)
            return await run_fresh_episode(
                sampler=self._placement.sampler(lease_id),
                task=task,
                env_factory=self._env_factory,
                renderer=self._renderer,
                params=self._params,
                limits=self._limits,
            )
        finally:
            self._placement.end(lease_id)  # the lease ends with the episode, also on error


def turn_max_tokens(rollout: RolloutConfig) -> int:
    """The sampling cap of one LLM call: `rollout.max_tokens_per_turn`, or with 0 the whole
    episode's `rollout.max_tokens` (which also bounds every turn together, in `EpisodeLimits`)."""
    return rollout.max_tokens_per_turn or rollout.max_tokens


def episode_limits(cfg: DoraConfig) -> EpisodeLimits:
    """The limits of one episode, from `rollout.*`, `env.*` and `model.max_model_len`."""
    return EpisodeLimits(
        max_turns=cfg.rollout.max_turns,
        max_total_tokens=cfg.rollout.max_tokens,
        context_limit=cfg.model.max_model_len,
        tool_timeout_s=cfg.rollout.tool_timeout_s,
        step_timeout_s=cfg.env.step_timeout_s,
        reward_timeout_s=cfg.env.reward_timeout_s,
        episode_timeout_s=cfg.env.episode_timeout_s,
    )
