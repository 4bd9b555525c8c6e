"""The rollout loop: the transfer queue, the orchestrator and the trainer link, on real instances.

One `Rollout` owns, in one event loop and one `asyncio.TaskGroup`:
- the transfer queue (`dora.core.transfer_queue`, the staleness gate) and the orchestrator
  (`dora.core.orchestrator`, versions -> instances), both driven unchanged;
- the router (leases and moves, `router.py`) and the weight store (`weights.py`);
- the dispatcher (admission and episodes, `dispatcher.py`);
- the link to the trainer: assigned groups go out in assignment order, `StepClosed` after the
  `B`-th group of a step; `WeightChunk`/`WeightsReady`/`StepDone`/`Durable` come back;
- the metrics ticker (`metrics.py`).

Event flow. Every state change that can unblock admission (a group completes, a lease ends, a
version loads, a step is acknowledged) sets `changed`; the dispatcher waits on it, never polls.
Orchestrator actions are applied at once to the router's state (`Migrate`, `Park`, `Resume` are
bookkeeping plus an interrupt RPC in a task); a `Load` runs in its own task, serialised per
instance, after the instance's last call has returned.

A version `v` is handed to the orchestrator (`publish`) when both `StepDone(v - 1)` arrived and its
weights are complete in the store; instances load it as the orchestrator says, and the transfer
queue learns of it (`on_version_loaded`) when the first instance holds it: admission binds groups
to the newest *loaded* version (bind late).

The run ends when every step is filled and sent, the trainer acknowledged the last step (bounded
wait), and `Shutdown` is sent. Every wait on the trainer that blocks progress has a deadline
(`serve.request_timeout_s`), and says what it waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from dora.config import DoraConfig
from dora.core.orchestrator import Action, Drain, Load, Migrate, Mode, Orchestrator, Park, Resume
from dora.core.transfer_queue import Assigned, RefusalReason, TransferQueue
from dora.errors import ProtocolError, ServerTimeout, ServerUnavailable
from dora.link import ServeLink
from dora.protocol import (
    Assigned as AssignedMessage,
)
from dora.protocol import (
    Durable,
    Group,
    Hello,
    Shutdown,
    StepClosed,
    StepDone,
    WeightChunk,
    WeightsReady,
)
from dora.serve.instances import InstanceHandle
from dora.serve.metrics import MetricsLog, Progress, Record, Ticker
from dora.serve.router import Router
from dora.serve.weights import WeightStore, read_folder

__all__ = ["Rollout", "RolloutReport"]

log = logging.getLogger("dora.serve")


class _RunComplete(Exception):
    """Raised inside the task group to end the run normally."""


@dataclass(kw_only=True)
class RolloutReport:
    """What a finished run did (also the `summary` record)."""

    mode: str
    steps: int
    groups_sent: int
    wall_s: float
    max_versions_serving: int
    utilisation: dict[str, float]
    staleness_histogram: list[int]
    migrations: int
    kv_migrations: int
    resubmissions: int
    parks: int
    missed_interrupts: int
    failed_calls: int
    instances_failed: list[str]
    weight_loads: int
    weight_load_s: float
    admission_wait_s: dict[str, float]
    trainer_wait_s: float
    max_loop_lag_ms: float
    steps_trained: int
    tick_versions_serving: int = 0
    """Most versions with calls in flight seen by a metrics tick (coarser than the router's)."""
    extra: dict[str, float] = field(default_factory=dict)


class Rollout:
    """The rollout side of a run. `await Rollout(...).run()` returns when the run is done."""

    def __init__(
        self,
        config: DoraConfig,
        *,
        instances: list[InstanceHandle],
        link: ServeLink,
        model_dir: str,
        run_dir: Path,
        dispatcher_factory: Callable[[Rollout], Any],
        progress: bool = False,
    ) -> None:
        r = config.rollout
        self.config = config
        self.group_size = r.group_size
        self.batch_size = r.batch_size
        self.num_steps = config.learn.steps
        self.mode = Mode(r.mode)
        self.queue = TransferQueue(
            groups_per_step=r.batch_size,
            max_staleness=r.staleness,
            num_steps=config.learn.steps,
            max_retries=r.max_retries if r.on_env_error == "retry" else 0,
            legacy_filling=r.legacy_filling,
        )
        self.orchestrator = Orchestrator(mode=self.mode)
        self.router = Router(
            kv_migration=config.serve.kv_migration,
            control_timeout_s=config.serve.weight_load_timeout_s,
        )
        self.store = WeightStore()
        self.store.add_path(0, model_dir)
        self.link = link
        self.changed = asyncio.Event()
        self.groups: dict[str, Group] = {}
        """Completed groups by id, kept until the step that consumed them is durable."""
        self.completed = 0
        self.trainer_wait_s = 0.0
        self.admission_wait_s: dict[str, float] = {r.value: 0.0 for r in RefusalReason}
        self.weight_loads = 0
        self.weight_load_s = 0.0
        self._instances = instances
        self._outbox: asyncio.Queue[Assigned] = asyncio.Queue(
            maxsize=(r.staleness + 3) * r.batch_size
        )
        self._sent_per_step: dict[int, int] = {}
        self._step_versions: dict[int, list[int]] = {}
        self._step_started = time.monotonic()
        self._trained = -1
        self._trained_event = asyncio.Event()
        self._trained_at: dict[int, float] = {}
        self._trainer_stopped = False
        self._dead: set[str] = set()
        self._all_sent = asyncio.Event()
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._start = time.monotonic()
        self._last_busy: dict[str, tuple[float, float]] = {}
        self._tick_versions_serving = 0
        self.metrics = MetricsLog(run_dir)
        self._progress = Progress(total_steps=self.num_steps) if progress else None
        self.ticker = Ticker(
            self.metrics,
            self.snapshot,
            every_s=config.log.metrics_every_s,
            progress=self._progress,
        )
        self.dispatcher = dispatcher_factory(self)

    # --- lifetime ----------------------------------------------------------------------------

    async def run(self) -> RolloutReport:
        self._start = time.monotonic()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self.router.on_failure = self.instance_failed
                for h in self._instances:
                    self.router.add_instance(h.id, h.client, version=0)
                    self._load_locks[h.id] = asyncio.Lock()
                    self.apply(
                        self.orchestrator.add_instance(h.id, capacity=self.config.serve.max_running)
                    )
                tg.create_task(self._receive(), name="trainer-receive")
                tg.create_task(self._send(), name="trainer-send")
                tg.create_task(self.dispatcher.run(), name="dispatcher")
                tg.create_task(self.ticker.run(), name="metrics")
                tg.create_task(self._finish(), name="finish")
        except* _RunComplete:
            pass
        finally:
            self._tg = None
            if self._progress is not None:
                self._progress.close()
            report = self.report()
            self.metrics.write("summary", msgspec.to_builtins(report))
            self.metrics.close()
        return report

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> None:
        """Run `coro` in the run's task group (one crash stops the run)."""
        assert self._tg is not None, "the rollout is not running"
        self._tg.create_task(coro, name=name)

    async def _finish(self) -> None:
        await self._all_sent.wait()
        last = self.num_steps - 1
        timeout_s = self.config.serve.request_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                while self._trained < last:
                    self._trained_event.clear()
                    await self._trained_event.wait()
        except TimeoutError:
            log.warning("the trainer did not acknowledge step %d within %g s", last, timeout_s)
        if not self._trainer_stopped:
            # The trainer may have finished and closed its end first: nothing left to tell it.
            with contextlib.suppress(ServerUnavailable):
                await self.link.send(Shutdown(reason="rollout finished"), timeout_s=timeout_s)
        self.ticker.emit(0.0)
        raise _RunComplete

    # --- orchestrator actions ----------------------------------------------------------------

    def apply(self, actions: list[Action]) -> None:
        """Carry out orchestrator actions, in order (state at once, RPCs in tasks)."""
        for action in actions:
            match action:
                case Load(instance=i, version=v):
                    inst = self.router.instances[i]
                    if inst.version == v and not self._load_locks[i].locked():
                        # Already holds it (every instance starts with version 0).
                        self._loaded(i, v)
                    else:
                        self.spawn(self._load(i, v), name=f"load-{i}-v{v}")
                case Drain(instance=i):
                    self.metrics.write("drain", {"instance": i})
                case Migrate(request=rid, dst=dst):
                    if self.router.move(rid, dst):
                        self.spawn(self.router.interrupt(rid, export=True), name=f"move-{rid}")
                case Park(request=rid):
                    if self.router.park(rid):
                        self.spawn(self.router.interrupt(rid, export=False), name=f"park-{rid}")
                case Resume(request=rid, instance=i, version=v):
                    self.router.resume(rid, i, v)
        self.changed.set()

    def _target(self, instance: str) -> int | None:
        """The version the orchestrator wants on `instance` (None: none, or it is gone)."""
        for view in self.orchestrator.instances():
            if view.id == instance:
                return view.version
        return None

    def instance_failed(self, instance: str) -> None:
        """An instance is unreachable: its leases continue on instances of their version (or are
        parked until one has room); it gets no more work."""
        if instance in self._dead:
            return
        self._dead.add(instance)
        log.warning("instance %s is unreachable; moving its requests", instance)
        self.metrics.write("instance_failed", {"instance": instance})
        self.apply(self.orchestrator.remove_instance(instance))
        if not self.orchestrator.instances():
            raise ServerUnavailable("every inference instance is gone")

    def _loaded(self, instance: str, version: int) -> None:
        self.queue.on_version_loaded(version)
        self.apply(self.orchestrator.on_loaded(instance, version))

    async def _load(self, instance: str, version: int) -> None:
        timeout_s = self.config.serve.weight_load_timeout_s
        async with self._load_locks[instance]:
            if self._target(instance) != version:
                return  # the orchestrator gave the instance another version since (or lost it)
            try:
                async with asyncio.timeout(timeout_s):
                    await self.router.wait_idle(instance)
            except TimeoutError:
                raise ServerTimeout(
                    f"instance {instance} still had calls in flight {timeout_s:g} s after it was "
                    f"emptied for version {version}"
                ) from None
            if self._target(instance) != version:
                return  # changed while we waited (the store may have dropped `version` since)
            weights = self.store.get(version)
            started = time.monotonic()
            client = self.router.instances[instance].client
            tensors = None
            if not weights.path:
                tensors = {
                    n: (d, s, b)
                    for n, d, s, b in zip(
                        weights.names, weights.dtypes, weights.shapes, weights.data, strict=True
                    )
                }
            try:
                await client.load_weights(
                    version, path=weights.path or None, tensors=tensors, timeout_s=timeout_s
                )
            except ServerUnavailable:
                self.instance_failed(instance)
                return
            seconds = time.monotonic() - started
            self.router.instances[instance].version = version
            self.weight_loads += 1
            self.weight_load_s += seconds
            self.metrics.write(
                "weight_load", {"instance": instance, "version": version, "seconds": seconds}
            )
        self._loaded(instance, version)

    # --- the trainer link --------------------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            message = await self.link.recv()
            match message:
                case Hello():
                    await self._hello(message)
                case WeightChunk():
                    if self.store.on_chunk(message):
                        self._maybe_publish()
                case WeightsReady(path=path) if path:
                    chunk = await asyncio.to_thread(read_folder, path, message.version)
                    ready = msgspec.structs.replace(message, path="", num_chunks=1)
                    if self.store.on_chunk(chunk) or self.store.on_ready(ready):
                        self._maybe_publish()
                case WeightsReady():
                    if self.store.on_ready(message):
                        self._maybe_publish()
                case StepDone(step=step, incarnation=inc, metrics=m):
                    if self.queue.on_step_done(step, incarnation=inc):
                        self._trained = max(self._trained, step)
                        self._trained_at[step] = time.monotonic()
                        self._trained_event.set()
                        self.metrics.write("trained", {"step": step, "metrics": m})
                        self._maybe_publish()
                        self.changed.set()
                case Durable(step=step, incarnation=inc):
                    for gid in self.queue.on_durable(step, incarnation=inc):
                        self.groups.pop(gid, None)
                    self._retain_weights()
                case Shutdown(reason=reason):
                    if not self.queue.finished or self._trained < self.num_steps - 1:
                        raise ProtocolError(f"the trainer shut down before the run ended: {reason}")
                    self._trainer_stopped = True

    async def _hello(self, hello: Hello) -> None:
        if hello.incarnation != self.queue.incarnation:
            # Trainer restarts (rollback to a checkpoint) are not wired into serve yet.
            raise ProtocolError(
                f"trainer incarnation {hello.incarnation} at step {hello.step}, serve is at "
                f"incarnation {self.queue.incarnation}: restarting a trainer is not supported yet"
            )
        log.info("trainer connected (incarnation %d, step %d)", hello.incarnation, hello.step)
        await self.link.send(
            Hello(role="serve", incarnation=self.queue.incarnation, step=self.queue.step)
        )

    def _maybe_publish(self) -> None:
        """Hand the newest published version whose weights are complete to the orchestrator."""
        v = self.queue.published_version
        if self.queue.finished:
            return  # every step is filled: nothing will be sampled by a newer version
        if v > self.orchestrator.newest and self.store.has(v):
            self.apply(self.orchestrator.publish(v))
            self._retain_weights()

    def _retain_weights(self) -> None:
        keep = {0, self.orchestrator.newest, self.queue.published_version}
        keep |= set(self.queue.version_counts())
        keep |= set(self.orchestrator.live())
        keep |= {i.version for i in self.orchestrator.instances() if i.version is not None}
        if self.config.rollout.legacy_filling:
            keep |= set(range(max(0, self.queue.step - self.queue.max_staleness), v_max(keep) + 1))
        self.store.retain(keep)

    # --- groups out ----------------------------------------------------------------------------

    def group_done(self, group: Group, assigned: list[Assigned]) -> None:
        """A group completed (or was masked): keep it, queue what the completion assigned."""
        self.groups[group.id] = group
        self.completed += 1
        self.assigned(assigned)

    def assigned(self, assigned: list[Assigned] | tuple[Assigned, ...]) -> None:
        for a in assigned:
            # Bounded by the queue's invariant: at most (K + 2) * B groups are assigned and not
            # yet trained, so a full outbox is a bug, not backpressure.
            self._outbox.put_nowait(a)
        self.changed.set()

    async def _send(self) -> None:
        timeout_s = self.config.serve.request_timeout_s
        while True:
            a = await self._outbox.get()
            group = self.groups[a.group_id]
            await self.link.send(AssignedMessage(step=a.step, group=group), timeout_s=timeout_s)
            n = self._sent_per_step[a.step] = self._sent_per_step.get(a.step, 0) + 1
            self._step_versions.setdefault(a.step, []).append(a.version)
            if n == self.batch_size:
                await self.link.send(StepClosed(step=a.step, num_groups=n), timeout_s=timeout_s)
                now = time.monotonic()
                # The trainer waited for this step if it had finished the previous one (or, for
                # step 0, since the start) before the step's last group went out.
                ready_at = self._start if a.step == 0 else self._trained_at.get(a.step - 1)
                if ready_at is not None:
                    self.trainer_wait_s += max(0.0, now - ready_at)
                versions = self._step_versions.pop(a.step)
                self.metrics.write(
                    "step",
                    {
                        "step": a.step,
                        "versions": versions,
                        "staleness": [a.step - v for v in versions],
                        "fill_s": now - self._step_started,
                    },
                )
                self._step_started = now
                if a.step == self.num_steps - 1:
                    self._all_sent.set()

    # --- metrics -------------------------------------------------------------------------------

    def snapshot(self, lag_ms: float) -> Record:
        now = time.monotonic()
        instances = []
        for view in self.orchestrator.instances():
            state = self.router.instances[view.id]
            busy = state.busy_until(now)
            last_t, last_busy = self._last_busy.get(view.id, (self._start, 0.0))
            util = (busy - last_busy) / (now - last_t) if now > last_t else 0.0
            self._last_busy[view.id] = (now, busy)
            instances.append(
                {
                    "id": view.id,
                    "version": view.version,
                    "ready": view.ready,
                    "draining": view.draining,
                    "leases": view.load,
                    "capacity": view.capacity,
                    "inflight": state.inflight,
                    "util": round(min(1.0, util), 4),
                    "tokens": state.tokens,
                }
            )
        serving = self.router.versions_serving()
        self._tick_versions_serving = max(self._tick_versions_serving, len(serving))
        acct = self.queue.accounting()
        return {
            "step": self.queue.step,
            "trained": self._trained,
            "newest": self.queue.newest_version,
            "published": self.queue.published_version,
            "instances": instances,
            "live_per_version": self.orchestrator.live(),
            "serving_versions": serving,
            "queue_per_version": {
                w: dataclasses.asdict(c) for w, c in self.queue.version_counts().items()
            },
            "staleness_histogram": self.queue.staleness_histogram(),
            "admitted": acct.admitted,
            "completed": self.completed,
            "assigned": acct.consumed,
            "masked": acct.masked,
            "retried": acct.retried,
            "migrations": self.router.migrations,
            "kv_migrations": self.router.kv_migrations,
            "resubmissions": self.router.resubmissions,
            "parks": self.router.parks,
            "missed_interrupts": self.router.missed_interrupts,
            "failed_calls": self.router.failed_calls,
            "instances_failed": sorted(self._dead),
            "weight_loads": self.weight_loads,
            "weight_load_s": round(self.weight_load_s, 4),
            "weights_held": self.store.versions(),
            "admission_wait_s": {k: round(v, 4) for k, v in self.admission_wait_s.items() if v},
            "trainer_wait_s": round(self.trainer_wait_s, 4),
            "loop_lag_ms": round(lag_ms, 3),
        }

    def report(self) -> RolloutReport:
        wall = time.monotonic() - self._start
        util = {
            i.id: round(i.busy_until(time.monotonic()) / wall, 4) if wall > 0 else 0.0
            for i in self.router.instances.values()
        }
        return RolloutReport(
            mode=self.mode.value,
            steps=self.queue.step,
            groups_sent=sum(self._sent_per_step.values()),
            wall_s=round(wall, 3),
            max_versions_serving=self.router.max_versions_serving,
            utilisation=util,
            staleness_histogram=self.queue.staleness_histogram(),
            migrations=self.router.migrations,
            kv_migrations=self.router.kv_migrations,
            resubmissions=self.router.resubmissions,
            parks=self.router.parks,
            missed_interrupts=self.router.missed_interrupts,
            failed_calls=self.router.failed_calls,
            instances_failed=sorted(self._dead),
            weight_loads=self.weight_loads,
            weight_load_s=round(self.weight_load_s, 4),
            admission_wait_s={k: round(v, 4) for k, v in self.admission_wait_s.items()},
            trainer_wait_s=round(self.trainer_wait_s, 4),
            max_loop_lag_ms=round(self.ticker.max_lag_ms, 3),
            steps_trained=self._trained + 1,
            tick_versions_serving=self._tick_versions_serving,
        )


def v_max(versions: set[int]) -> int:
    return max(versions, default=0)
