"""The dispatcher: dataset -> groups -> G episodes each, admitted through the transfer queue.

Admission binds late (docs/scheduling.md, "Admission"): a group is admitted only at the
newest version published to the orchestrator, once an instance holds it (while it loads, admission
waits), when the transfer queue allows one more group *and* an instance holding that version has
room for all `G` samples. While admissible groups wait for such an instance, the dispatcher reports
one group's samples as the orchestrator's demand (`set_demand`; 0 while the queue is what blocks),
so old versions are consolidated only when the newest version needs the room. A group is placed
on the least loaded such instance (by the orchestrator), started at once, and its `G` episodes run
concurrently, each with a `LeaseSampler` pinned to the group's version. When admission is refused
the dispatcher waits on the rollout's `changed` event (set by every completion, lease end, version
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
newest version, before it admits new groups (`Rollout.lost_groups`, `TransferQueue.restart`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dora.config import DoraConfig
from dora.core.transfer_queue import Admitted, RefusalReason
from dora.env import Env, PromptStream, Task
from dora.episode import ChatRenderer, EpisodeLimits, masked_sample, run_episode
from dora.errors import ServerTimeout
from dora.protocol import Group, Sample, SamplingParams

if TYPE_CHECKING:
    from dora.serve.rollout import Rollout

__all__ = ["Dispatcher", "episode_limits", "episode_on_lease"]

log = logging.getLogger("dora.serve")


class Dispatcher:
    """Admits groups and runs their episodes (see the module docstring)."""

    def __init__(
        self,
        rollout: Rollout,
        *,
        tasks: PromptStream,
        env_factory: Callable[[], Env],
        renderer: ChatRenderer,
    ) -> None:
        cfg = rollout.config
        self._r = rollout
        self._tasks = tasks
        self._env_factory = env_factory
        self._renderer = renderer
        self._params = SamplingParams(
            max_tokens=turn_max_tokens(cfg),
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
        )
        self._limits = episode_limits(cfg)
        self._on_error = cfg.rollout.on_env_error
        self._trainer_timeout_s = cfg.serve.request_timeout_s
        restored = rollout.restored
        self._next = restored.next_group
        self._positions = restored.task_positions
        if restored.starts:
            self._tasks.position = restored.prompt_position

    async def run(self) -> None:
        r, q, g = self._r, self._r.queue, self._r.group_size
        # No exit when every step is filled: a trainer restart may roll the queue back. The run
        # ends when the rollout's task group does.
        while True:
            r.changed.clear()
            version = r.orchestrator.newest
            if self._restart_lost(version):
                continue
            reason = q.admission_blocker(version)
            if reason is None and r.orchestrator.can_place(g, version=version) is None:
                reason = RefusalReason.NO_CAPACITY
            if reason is not None:
                waiting = reason in (RefusalReason.NO_CAPACITY, RefusalReason.WEIGHTS_NOT_LOADED)
                if r.orchestrator.demand != (g if waiting else 0):
                    r.apply(r.orchestrator.set_demand(g if waiting else 0))
                await self._wait(reason)
                continue
            gid = f"g{self._next}"
            self._next += 1
            admitted = q.try_admit(gid, version=version)
            assert isinstance(admitted, Admitted) and admitted.version == version
            q.task(gid, self._tasks.position)
            task = self._tasks.next()
            self._place(gid, version)
            r.group_tasks[gid] = r.spawn(self._run_group(gid, task, version), name=f"group-{gid}")
            # Let the group's episodes start before the next admission: a step's burst of
            # hundreds of groups then never holds the loop for seconds (timers, the link).
            await asyncio.sleep(0)

    def _restart_lost(self, version: int) -> bool:
        """Restart one group lost with a previous `dora serve`, at `version` (the newest), if an
        instance has room; True if one was restarted."""
        r, q = self._r, self._r.queue
        for gid in r.lost_groups():
            if q.group_version(gid) > version or q.admission_blocker(version) in (
                RefusalReason.WEIGHTS_NOT_LOADED,
                RefusalReason.NOT_NEWEST,
            ):
                return False  # the trainer's version is not loaded yet
            if r.orchestrator.can_place(r.group_size, version=version) is None:
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
            r.restored.lost.remove(gid)
            r.assigned(q.restart(gid, version=version))
            self._place(gid, version)
            r.group_tasks[gid] = r.spawn(self._run_group(gid, task, version), name=f"group-{gid}")
            return True
        return False

    async def _wait(self, reason: RefusalReason) -> None:
        """Wait for a state change; only a wait for the trainer's weights has a deadline (it is
        the one that needs another process to make progress)."""
        r = self._r
        r.queue.record_admission_wait(reason)
        started = time.monotonic()
        nothing_running = not r.orchestrator.live()
        newest = r.orchestrator.newest
        loading = any(v.version == newest and not v.ready for v in r.orchestrator.instances())
        try:
            if reason is RefusalReason.WEIGHTS_NOT_LOADED and nothing_running and not loading:
                async with asyncio.timeout(self._trainer_timeout_s):
                    await r.changed.wait()
            else:
                await r.changed.wait()
        except TimeoutError:
            raise ServerTimeout(
                f"waited {self._trainer_timeout_s:g} s for version "
                f"{r.queue.step - r.queue.max_staleness} from the trainer (step {r.queue.step}, "
                f"newest loaded {r.queue.newest_version}); is dora learn running?"
            ) from None
        finally:
            r.admission_wait_s[reason.value] += time.monotonic() - started

    def _place(self, gid: str, version: int) -> list[str]:
        r = self._r
        leases = [f"{gid}/{i}" for i in range(r.group_size)]
        where = r.orchestrator.place(leases, version=version)
        assert where is not None, "can_place said there was room"
        r.queue.start(gid)
        for lid in leases:
            r.router.open(lid, version=version, instance=where)
        return leases

    async def _run_group(self, gid: str, task: Task, version: int) -> None:
        try:
            await self._run_group_once(gid, task, version)
        finally:
            self._r.group_tasks.pop(gid, None)

    async def _run_group_once(self, gid: str, task: Task, version: int) -> None:
        r = self._r
        leases = [f"{gid}/{i}" for i in range(r.group_size)]
        while True:
            async with asyncio.TaskGroup() as tg:
                running = [tg.create_task(self._episode(lid, task)) for lid in leases]
            samples = [t.result() for t in running]
            if self._on_error == "retry" and any(s.masked for s in samples):
                room = r.orchestrator.can_place(r.group_size, version=version) is not None
                outcome = r.queue.fail(gid, retry_allowed=room)
                if outcome.retried:
                    log.info("group %s failed; retrying at version %d", gid, version)
                    self._place(gid, version)
                    continue
                group = self._group(gid, task, version, samples)
                r.group_done(group, list(outcome.assigned))
                return
            group = self._group(gid, task, version, samples)
            r.group_done(group, r.queue.complete(gid))
            return

    def _group(self, gid: str, task: Task, version: int, samples: list[Sample]) -> Group:
        group = Group(
            id=gid,
            prompt_id=task.prompt_id,
            version=version,
            samples=samples,
            incarnation=self._r.queue.incarnation,
        )
        self._r.queue.keep(group)  # journaled before the queue hears it is complete
        return group

    async def _episode(self, lease_id: str, task: Task) -> Sample:
        r = self._r
        try:
            return await episode_on_lease(
                r,
                lease_id,
                task,
                env_factory=self._env_factory,
                renderer=self._renderer,
                params=self._params,
                limits=self._limits,
            )
        finally:
            # The lease ends with the episode (also on error or cancellation): its slot is free.
            if r.router.close(lease_id):  # else a roll-back removed it everywhere already
                actions = r.orchestrator.finish(lease_id)
                task_now = asyncio.current_task()
                if task_now is None or not task_now.cancelling():  # no new tasks while stopping
                    r.apply(actions)


def turn_max_tokens(cfg: DoraConfig) -> int:
    """The sampling cap of one LLM call: `rollout.max_tokens_per_turn`, or with 0 the whole
    episode's `rollout.max_tokens` (which also bounds every turn together, in `EpisodeLimits`)."""
    return cfg.rollout.max_tokens_per_turn or cfg.rollout.max_tokens


def episode_limits(cfg: DoraConfig) -> EpisodeLimits:
    """The limits of one episode, from `rollout.*` and `model.max_model_len`."""
    return EpisodeLimits(
        max_turns=cfg.rollout.max_turns,
        max_total_tokens=cfg.rollout.max_tokens,
        context_limit=cfg.model.max_model_len,
        tool_timeout_s=cfg.rollout.tool_timeout_s,
    )


async def episode_on_lease(
    rollout: Rollout,
    lease_id: str,
    task: Task,
    *,
    env_factory: Callable[[], Env],
    renderer: ChatRenderer,
    params: SamplingParams,
    limits: EpisodeLimits,
) -> Sample:
    """One episode of `task` through the lease's sampler; an env factory that raises gives a masked
    sample (the lease is the caller's to end)."""
    try:
        env = env_factory()
    except Exception as exc:
        log.warning("env factory raised", exc_info=True)
        return masked_sample(task, f"env factory: {exc!r}")
    return await run_episode(
        sampler=rollout.router.sampler(lease_id),
        tokenizer=renderer,
        env=env,
        task=task,
        params=params,
        limits=limits,
    )
