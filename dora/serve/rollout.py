"""The rollout loop: the transfer queue, the orchestrator and the trainer link, on real instances.

One `Rollout` owns, in one event loop and one `asyncio.TaskGroup`:
- the transfer queue (`dora.core.transfer_queue`, the staleness gate) and the orchestrator
  (`dora.core.orchestrator`, versions -> instances), both driven unchanged;
- the router (leases and moves, `router.py`) and the weight store (`weights.py`);
- the dispatcher (admission and episodes, `dispatcher.py`);
- the link to the trainer: assigned groups go out in assignment order, `StepClosed` after the
  `B`-th group of a step; `WeightChunk`/`WeightsReady`/`StepDone`/`Durable` come back;
- the metrics ticker (`metrics.py`);
- evaluation while training (`evaluate.py`), when `data.eval_source` is set: held-out episodes on
  leases of the newest loaded version, never groups; the final version is loaded and evaluated
  once every step is trained, before `Shutdown`.

Event flow. Every state change that can unblock admission (a group completes, a lease ends, a
version loads, a step is acknowledged) sets `changed`; the dispatcher waits on it, never polls.
Orchestrator actions are applied at once to the router's state (`Migrate`, `Park`, `Resume` are
bookkeeping plus an interrupt RPC in a task); a `Load` runs in its own task, serialised per
instance, after the instance's last call has returned.

A version `v` is handed to the orchestrator (`publish`) when both `StepDone(v - 1)` arrived and its
weights are complete in the store; instances load it as the orchestrator says, and the transfer
queue learns of it (`on_version_loaded`) when the first instance holds it: admission binds groups
to the newest *published* version once an instance holds it, and waits while it loads (bind late;
docs/scheduling.md says why not the previous version).

A trainer restarted from its checkpoint says `Hello` with a new incarnation and the step it resumes
at: the queue rolls back (`TransferQueue.rollback`), running groups of ghost versions are stopped
and removed, unsent assignments of the lost run are dropped, instances holding ghosts load the real
version, and filling resumes. The store keeps every version newer than the last durable
step for this (a resumed trainer now publishes its starting version again, so this could shrink to
what the queue and the orchestrator still use). A trainer
that goes away is waited for (bounded) before anything more is sent.

Faults. Every queue operation and every completed group's samples go to the run's
journal (`journal.py`); a `dora serve` started on a run directory that holds one replays it:
completed groups are offered to the (restarted) trainer again, and groups whose episodes died
with the previous process are restarted at the newest version once the trainer has said hello
and rolled back (`TransferQueue.restart`, counted). An instance that dies is replaced (when the
pool can start instances: `replace_instance`), at most `serve.max_instance_restarts` times in a
run; the replacement loads the version the orchestrator gives it from the weight store. A weight
load that times out is retried `serve.weight_load_retries` times; then the instance counts as
dead and is replaced.

The run ends when every step is filled and sent, the trainer made the last step durable (`Durable`
after its final checkpoint; bounded wait: a trainer that dies before it resumes and trains the last
steps again from the groups serve holds), the final version is evaluated, and `Shutdown` is sent.
With `learn.max_minutes`, the first `StepDone` after the budget (on serve's clock) ends the run
early: under the send lock, the newest step already closed becomes the last one, `Shutdown` goes
to the trainer in place of the next step's groups (it trains what it has, checkpoints the last
step and stops), nothing more is sent, and the run ends as above at that step (groups admitted
for later steps are left unassigned: counted in the summary). Every wait on the trainer that
blocks progress has a deadline (`serve.request_timeout_s`), and says what it waited for.

Length: past STYLE.md's 600 lines, on purpose: this is the one place where the trainer link, the
instances' lifetimes (loads, failures, replacements) and the journal meet the pure core, in one
event loop; split up, each part would need the others' state (queue, orchestrator, router, store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec

from dora.config import DoraConfig
from dora.core.orchestrator import (
    Action,
    Drain,
    Fail,
    Load,
    Migrate,
    Mode,
    Orchestrator,
    Park,
    Resume,
    Undrain,
)
from dora.core.transfer_queue import Assigned, GroupState, RefusalReason
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
from dora.serve.coretime import CoreClock
from dora.serve.evaluate import Evaluator
from dora.serve.health import HealthWatch
from dora.serve.history import History, check_not_all_masked, masked_reasons, read_history
from dora.serve.instances import InstanceHandle
from dora.serve.journal import JournaledQueue, Restored
from dora.serve.metrics import (
    MetricsLog,
    Progress,
    RolloutReport,
    SampleLog,
    Snapshots,
    Ticker,
)
from dora.serve.router import Router
from dora.serve.weights import WeightStore, read_folder
from dora.tracking import open_tracking

__all__ = ["Rollout", "RolloutReport"]

log = logging.getLogger("dora.serve")


class _RunComplete(Exception):
    """Raised inside the task group to end the run normally."""


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
        evaluator_factory: Callable[[Rollout], Evaluator] | None = None,
        progress: bool = False,
        replace_instance: Callable[[str], Awaitable[InstanceHandle]] | None = None,
        prompts_skipped: int = 0,
        eval_prompts_skipped: int = 0,
        sample_log: SampleLog | None = None,
    ) -> None:
        r = config.rollout
        self.config = config
        self.group_size = r.group_size
        self.batch_size = r.batch_size
        self.num_steps = config.learn.steps
        self.mode = Mode(r.mode)
        self.queue = JournaledQueue(
            run_dir,
            groups_per_step=r.batch_size,
            max_staleness=r.staleness,
            num_steps=config.learn.steps,
            max_retries=r.max_retries if r.on_env_error == "retry" else 0,
            legacy_filling=r.legacy_filling,
        )
        self.orchestrator = Orchestrator(mode=self.mode)
        # the orchestration overhead: time spent inside the queue and the orchestrator
        self.core = CoreClock()
        self.queue, self.orchestrator = (
            self.core.wrap(self.queue),
            self.core.wrap(self.orchestrator),
        )
        self.router = Router(
            # vLLM cannot move a request with its KV cache; the embedded and emulated engines can.
            kv_migration=config.serve.kv_migration and config.serve.backend != "vllm",
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
        self._replace_instance = replace_instance
        self.instance_restarts = 0
        self.weight_load_retries = 0
        self.prompts_skipped = prompts_skipped
        """Training tasks left out at load because their prompt does not fit the context."""
        self.eval_prompts_skipped = eval_prompts_skipped
        self._sample_log = sample_log
        self.restored = Restored()
        """What the journal held at start (`restored.starts > 0`: this serve is a restart)."""
        self.history = History()
        """What earlier serves of this run recorded (empty unless this serve is a restart)."""
        self.masked_samples = 0
        self.masked_reasons: dict[str, int] = {}
        self._lost_ready = asyncio.Event()
        """Set once groups lost with a previous serve may be restarted (the trainer said hello)."""
        self._outbox: asyncio.Queue[tuple[int, Assigned]] = asyncio.Queue(
            maxsize=(r.staleness + 3) * r.batch_size
        )
        self.sent_per_step: dict[int, int] = {}
        self._step_versions: dict[int, list[tuple[str, int]]] = {}
        self._step_started = time.monotonic()
        self.trained_step = -1
        self._trained_event = asyncio.Event()
        self._trained_at: dict[int, float] = {}
        self._trainer_stopped = False
        self.dead: set[str] = set()
        self._hello_seen = asyncio.Event()
        self._durable = -1
        self.group_tasks: dict[str, asyncio.Task[None]] = {}
        """Running groups (to stop them when a roll-back removes them)."""
        self._all_sent = asyncio.Event()
        """Every step the run will train is sent (the last of `learn.steps`, or of a budget)."""
        self._send_lock = asyncio.Lock()
        self._closed_step = -1
        """The newest step whose `StepClosed` went out: the trainer will train it."""
        self._end_step: int | None = None
        """The last step of a run cut short by `learn.max_minutes` (None: `learn.steps - 1`)."""
        self._budget_s = config.learn.max_minutes * 60
        self._budget_hit = False
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._tg: asyncio.TaskGroup | None = None
        self.started_at = time.monotonic()
        self.metrics = MetricsLog(run_dir, tracking=open_tracking(config, run_dir))
        self._progress = Progress(total_steps=self.num_steps) if progress else None
        self._snapshots = Snapshots(self)
        self.ticker = Ticker(
            self.metrics,
            self._snapshots.take,
            every_s=config.log.metrics_every_s,
            progress=self._progress,
        )
        self._restore()  # before the dispatcher, which continues the restored prompt stream
        self.dispatcher = dispatcher_factory(self)
        self.evaluator = evaluator_factory(self) if evaluator_factory is not None else None

    # --- lifetime ----------------------------------------------------------------------------

    async def run(self) -> RolloutReport:
        self.started_at = time.monotonic()
        self.metrics.write(
            "serve_start", {"serve_start": self.restored.starts + 1, "unix_time": time.time()}
        )
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
                if self.config.serve.health_timeout_s > 0:
                    tg.create_task(self._health().run(), name="health")
                tg.create_task(self._finish(), name="finish")
        except* _RunComplete:
            pass
        finally:
            self._tg = None
            if self._progress is not None:
                self._progress.close()
            report = self._snapshots.report()
            self._whole_run(report)
            acct = self.queue.accounting()
            report.extra.update(
                admitted=acct.admitted,
                consumed=acct.consumed,
                filtered=acct.filtered,
                rolled_back=acct.rolled_back,
                unassigned=acct.unassigned,
                masked=acct.masked,
                groups_restarted=acct.restarted,
                serve_restarts=self.restored.starts,
                instance_restarts=self.instance_restarts + self.history.instance_restarts,
                masked_samples=self.masked_samples + self.history.masked_samples,
                weight_load_retries=self.weight_load_retries,
                prompts_skipped=self.prompts_skipped,
                eval_prompts_skipped=self.eval_prompts_skipped,
            )
            self.metrics.write("summary", msgspec.to_builtins(report))
            self.metrics.close()
            self.queue.close()
        return report

    def _whole_run(self, report: RolloutReport) -> None:
        """A restored serve reports the whole run: what earlier serves recorded, added."""
        h = self.history
        report.instances_failed = h.instances_failed + report.instances_failed
        if h.started_unix is not None:
            report.wall_s = round(time.time() - h.started_unix, 3)
        if h.first_eval is not None:
            report.extra["eval_first_version"], report.extra["eval_first_accuracy"] = h.first_eval
        reasons = dict(h.masked_reasons)
        for reason, n in self.masked_reasons.items():
            reasons[reason] = reasons.get(reason, 0) + n
        report.masked_reasons = reasons

    def _restore(self) -> None:
        """Replay the journal of a `dora serve` that ran on this run directory before."""
        restored = self.restored = self.queue.restore()
        if not restored.starts:
            return
        self.history = read_history(self.metrics.path)
        self.groups = dict(restored.groups)
        self.completed = len(restored.groups)
        self.trained_step = restored.trained_step
        self._durable = restored.durable_step
        acct = self.queue.accounting()
        log.warning(
            "restored from the journal (start %d): step %d, %d groups held, %d to restart",
            restored.starts + 1,
            self.queue.step,
            len(restored.groups),
            len(restored.lost),
        )
        self.metrics.write(
            "restore",
            {
                "serve_start": restored.starts + 1,
                "step": self.queue.step,
                "incarnation": self.queue.incarnation,
                "groups_held": len(restored.groups),
                "lost": len(restored.lost),
                "admitted": acct.admitted,
                "consumed": acct.consumed,
                "rolled_back": acct.rolled_back,
            },
        )

    def lost_groups(self) -> list[str]:
        """Groups of a previous serve to restart now: empty until the trainer said hello (its
        roll-back removes the ghosts among them); those still unassigned after it."""
        if not self._lost_ready.is_set():
            return []
        lost = [
            gid
            for gid in self.restored.lost
            if self.queue.state(gid) in (GroupState.ADMITTED, GroupState.STARTED)
            or (self.queue.state(gid) is GroupState.COMPLETED and gid not in self.groups)
        ]
        self.restored.lost = lost
        return lost

    def version_trained_at(self, version: int) -> float | None:
        """When `version` was trained (its `StepDone` arrived), in seconds on the clock of the
        run's records (`time_s`); 0 for the initial weights; None if this serve did not see it."""
        if version == 0:
            return 0.0
        at = self._trained_at.get(version - 1)
        return None if at is None else at - self.metrics.start

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        """Run `coro` in the run's task group (one crash stops the run)."""
        assert self._tg is not None, "the rollout is not running"
        return self._tg.create_task(coro, name=name)

    def _last_step(self) -> int:
        return self.num_steps - 1 if self._end_step is None else self._end_step

    async def _finish(self) -> None:
        """Wait until the last step is durable (the trainer checkpoints it before it stops: a
        trainer that dies before that resumes and needs the groups serve still holds)."""
        timeout_s = self.config.serve.request_timeout_s
        last = self._last_step()
        while self._durable < last:
            await self._all_sent.wait()
            last = self._last_step()
            if self._durable < last:
                log.info(
                    "every step is sent; waiting up to %g s for the trainer to make step %d "
                    "durable (trained: %d, durable: %d)",
                    *(timeout_s, last, self.trained_step, self._durable),
                )
            try:
                async with asyncio.timeout(timeout_s):
                    # A roll-back clears `_all_sent` (and wakes this): the steps go out again.
                    while self._durable < last and self._all_sent.is_set():
                        self._trained_event.clear()
                        await self._trained_event.wait()
                        last = self._last_step()
            except TimeoutError:
                log.warning(
                    "the trainer did not make step %d durable within %g s (trained: %d)",
                    *(last, timeout_s, self.trained_step),
                )
                break
        if self.evaluator is not None:
            log.info("the run ends with step %d; evaluating the final version", last)
            await self._final_eval(timeout_s)
        if not self._trainer_stopped and self._end_step is None:
            # The trainer may have finished and closed its end first: nothing left to tell it.
            with contextlib.suppress(ServerUnavailable):
                await self.link.send(Shutdown(reason="rollout finished"), timeout_s=timeout_s)
        self.ticker.emit(0.0)
        raise _RunComplete

    async def _final_eval(self, timeout_s: float) -> None:
        """Load the final version (never handed to the orchestrator: every step was filled
        before it was published) and evaluate it; bounded by `timeout_s`."""
        assert self.evaluator is not None
        final = self.queue.published_version
        if not self.store.has(final):
            final = self.orchestrator.newest
        if final > self.orchestrator.newest:
            self.apply(self.orchestrator.publish(final))
            self._retain_weights()
        try:
            await self.evaluator.finish(final, timeout_s=timeout_s)
        except TimeoutError:
            log.warning("the final evaluation (v%d) did not finish in %g s", final, timeout_s)

    # --- orchestrator actions ----------------------------------------------------------------

    def apply(self, actions: list[Action]) -> None:
        """Carry out orchestrator actions, in order (state at once, RPCs in tasks)."""
        for action in actions:
            match action:
                case Load(instance=i, version=v):
                    inst = self.router.instances[i]
                    if inst.version == v and not self._load_locks[i].locked():
                        # Already holds it (every instance starts with version 0).
                        self._loaded(action)
                    else:
                        self.spawn(self._load(action), name=f"load-{i}-v{v}")
                case Drain(instance=i):
                    self.metrics.write("drain", {"instance": i})
                case Undrain(instance=i):  # placement asks the orchestrator; this is for the log
                    self.metrics.write("undrain", {"instance": i})
                case Migrate(request=rid, dst=dst):
                    if self.router.move(rid, dst):
                        self.spawn(self.router.interrupt(rid, export=True), name=f"move-{rid}")
                case Park(request=rid):
                    if self.router.park(rid):
                        self.spawn(self.router.interrupt(rid, export=False), name=f"park-{rid}")
                case Resume(request=rid, instance=i, version=v):
                    self.router.resume(rid, i, v)
                case Fail(request=rid, reason=reason):
                    self.metrics.write("request_failed", {"lease": rid, "reason": reason.value})
                    self.router.fail(rid, reason.value)
        self.changed.set()
        if self.evaluator is not None:
            self.evaluator.wake()

    def instance_failed(self, instance: str) -> None:
        """An instance is unreachable: its leases continue on instances of their version (or are
        parked until one has room); it gets no more work."""
        if instance in self.dead:
            return
        self.dead.add(instance)
        log.warning("instance %s is unreachable; moving its requests", instance)
        self.metrics.write("instance_failed", {"instance": instance})
        self.apply(self.orchestrator.remove_instance(instance))
        self._replace(instance)

    def _health(self) -> HealthWatch:
        return HealthWatch(
            targets=lambda: {
                i: s.client for i, s in self.router.instances.items() if i not in self.dead
            },
            on_dead=self.instance_unresponsive,
            timeout_s=self.config.serve.health_timeout_s,
        )

    def instance_unresponsive(self, instance: str, error: str) -> None:
        """An instance missed its health deadline (it may hang rather than be gone): dead, like
        one that is unreachable, and the calls still waiting on it are cut and resubmitted."""
        if instance in self.dead:
            return
        self.metrics.write("instance_unresponsive", {"instance": instance, "error": error})
        self.instance_failed(instance)
        cut = self.router.cut(instance)
        log.warning("instance %s missed its health deadline; %d calls cut", instance, cut)

    def _replace(self, instance: str) -> None:
        """Start a replacement for a dead instance, within `serve.max_instance_restarts`."""
        limit = self.config.serve.max_instance_restarts
        if self._replace_instance is not None and self.instance_restarts < limit:
            self.instance_restarts += 1
            self.spawn(self._start_replacement(instance), name=f"replace-{instance}")
        elif not self.orchestrator.instances():
            raise ServerUnavailable(
                f"every inference instance is gone (the last: {instance}); "
                f"{self.instance_restarts} of serve.max_instance_restarts = {limit} "
                "replacements were used"
            )

    async def _start_replacement(self, instance: str) -> None:
        try:
            handle = await self._replace_instance(instance)  # type: ignore[misc]
        except (ServerUnavailable, ServerTimeout) as exc:
            log.warning("replacing instance %s failed: %s", instance, exc)
            self.metrics.write("instance_restart_failed", {"instance": instance, "error": str(exc)})
            self._replace(instance)
            return
        log.warning("instance %s replaces %s", handle.id, instance)
        self.metrics.write("instance_restarted", {"instance": handle.id, "replaces": instance})
        self.router.add_instance(handle.id, handle.client, version=0)
        self._load_locks[handle.id] = asyncio.Lock()
        capacity = self.config.serve.max_running
        self.apply(self.orchestrator.add_instance(handle.id, capacity=capacity))

    def _loaded(self, load: Load) -> None:
        if self.orchestrator.pending_load(load.instance) != load:
            return  # superseded during the load (another Load, a roll-back, the instance died)
        self.queue.on_version_loaded(load.version)
        self.apply(self.orchestrator.on_loaded(load))
        # Evaluate only what an instance now holds, and in a restored serve only after the
        # trainer's roll-back: before it, the journal's newest version is weights no instance has.
        settled = not self.restored.starts or self._lost_ready.is_set()
        if self.evaluator is not None and settled and load.version == self.queue.newest_version:
            self.evaluator.on_loaded(load.version)

    async def _load(self, load: Load) -> None:
        instance, version = load.instance, load.version
        timeout_s = self.config.serve.weight_load_timeout_s
        async with self._load_locks[instance]:
            if self.orchestrator.pending_load(instance) != load:
                return  # the orchestrator gave the instance another load since (or lost it)
            try:
                async with asyncio.timeout(timeout_s):
                    await self.router.wait_idle(instance)
            except TimeoutError:
                raise ServerTimeout(
                    f"instance {instance} still had calls in flight {timeout_s:g} s after it was "
                    f"emptied for version {version}"
                ) from None
            if self.orchestrator.pending_load(instance) != load:
                return  # superseded while we waited (the store may have dropped `version` since)
            weights = self.store.get(version)
            started = time.monotonic()
            incarnation = self.queue.incarnation
            client = self.router.instances[instance].client
            tensors = None
            if not weights.path:
                tensors = {
                    n: (d, s, b)
                    for n, d, s, b in zip(
                        weights.names, weights.dtypes, weights.shapes, weights.data, strict=True
                    )
                }
            retries = self.config.serve.weight_load_retries
            for attempt in range(retries + 1):
                try:
                    await client.load_weights(
                        version, path=weights.path or None, tensors=tensors, timeout_s=timeout_s
                    )
                    break
                except ServerUnavailable:
                    self.instance_failed(instance)
                    return
                except ServerTimeout as exc:
                    what = f"the path {weights.path}" if weights.path else "inline tensors"
                    error = (
                        f"instance {instance} did not load version {version} from {what} within "
                        f"{timeout_s:g} s (attempt {attempt + 1} of {retries + 1}): {exc}"
                    )
                    log.warning("%s", error)
                    self.metrics.write(
                        "weight_load_timeout",
                        {
                            "instance": instance,
                            "version": version,
                            "attempt": attempt + 1,
                            "error": error,
                        },
                    )
                    if attempt == retries:  # stuck: replace it (bounded by its own limit)
                        self.instance_failed(instance)
                        return
                    self.weight_load_retries += 1
            seconds = time.monotonic() - started
            if incarnation != self.queue.incarnation and (
                self.orchestrator.pending_load(instance) != load
            ):
                # A roll-back superseded the load: `version` may now name other weights. (A
                # load it kept is of a real version, whose weights the roll-back kept too.)
                self.router.instances[instance].version = -1
                return
            self.router.instances[instance].version = version
            self.weight_loads += 1
            self.weight_load_s += seconds
            self.metrics.write(
                "weight_load", {"instance": instance, "version": version, "seconds": seconds}
            )
        self._loaded(load)

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
                case WeightsReady(path=path) if path and not self.store.has(message.version):
                    chunk = await asyncio.to_thread(read_folder, path, message.version)
                    ready = msgspec.structs.replace(message, path="", num_chunks=1)
                    if self.store.on_chunk(chunk) or self.store.on_ready(ready):
                        self._maybe_publish()
                case WeightsReady():
                    if self.store.on_ready(message):
                        self._maybe_publish()
                case StepDone(step=step, incarnation=inc, metrics=m):
                    if self.queue.on_step_done(step, incarnation=inc):
                        self.trained_step = max(self.trained_step, step)
                        self._trained_at[step] = time.monotonic()
                        self._trained_event.set()
                        self.metrics.write("trained", {"step": step, "metrics": m})
                        self._check_budget()
                        self._maybe_publish()
                        self.changed.set()
                case Durable(step=step, incarnation=inc):
                    for gid in self.queue.on_durable(step, incarnation=inc):
                        self.groups.pop(gid, None)
                    self.queue.compact(list(self.groups.values()))
                    if inc == self.queue.incarnation:
                        self._durable = max(self._durable, step)
                        self._trained_event.set()
                    self._retain_weights()
                case Shutdown(reason=reason):
                    if not self.queue.finished or self.trained_step < self.num_steps - 1:
                        raise ProtocolError(f"the trainer shut down before the run ended: {reason}")
                    self._trainer_stopped = True

    async def _hello(self, hello: Hello) -> None:
        q = self.queue
        if hello.incarnation < q.incarnation:
            log.warning("ignoring a hello from old trainer incarnation %d", hello.incarnation)
            return
        if hello.incarnation > q.incarnation:
            self._rollback(hello)
        elif self.restored.starts and not self._lost_ready.is_set():
            raise ProtocolError(
                f"dora serve restarted from its journal (trainer incarnation {q.incarnation}), but "
                f"the trainer that said hello is that same incarnation: restart it with "
                "`dora learn --resume` so it rolls back to its last checkpoint"
            )
        self._lost_ready.set()
        log.info("trainer connected (incarnation %d, step %d)", hello.incarnation, hello.step)
        self._hello_seen.set()
        try:
            await self.link.send(Hello(role="serve", incarnation=q.incarnation, step=q.step))
        except ServerUnavailable:
            # It said hello and left before the answer (a trainer resumed past its last step has
            # nothing to train). Not an error: a send that needs a trainer waits for the next
            # hello (`_deliver`), and a finished run needs none.
            log.info("the trainer left before serve answered its hello")

    def _rollback(self, hello: Hello) -> None:
        """A restarted trainer resumes at `hello.step` from the checkpoint of the step before
        (docs/reliability.md): groups of versions it will not reproduce ("ghosts", newer than
        `hello.step`) are stopped and removed, the others are offered again, instances holding
        ghosts load the real version, and filling resumes at `hello.step`."""
        q, c = self.queue, hello.step - 1
        if c >= q.step:
            raise ProtocolError(
                f"the trainer resumes at step {hello.step}, but serve only filled {q.step} steps"
            )
        log.warning(
            "trainer restarted (incarnation %d) from the checkpoint of step %d; rolling back",
            hello.incarnation,
            c,
        )
        # The checkpoint holds step c, so the trainer trained it: StepDones it sent just before
        # it died may have been lost with it.
        for step in range(q.trained_step + 1, c + 1):
            q.on_step_done(step)
        rolled_back: list[str] = []
        assigned: list[Assigned] = []
        tainted = self._ghost_tainted(c + 1)
        while q.incarnation < hello.incarnation:
            report = q.rollback(c, tainted=tainted)
            rolled_back += report.rolled_back
            assigned = list(report.assigned)  # a later roll-back voids earlier ones
        for gid in rolled_back:
            self.groups.pop(gid, None)
            task = self.group_tasks.pop(gid, None)
            if task is not None:  # still running: stop its episodes, their leases go first
                for i in range(self.group_size):
                    self.router.close(f"{gid}/{i}")
                task.cancel()
        while not self._outbox.empty():  # assignments of the lost run that were not sent yet
            self._outbox.get_nowait()
        self.sent_per_step = {s: n for s, n in self.sent_per_step.items() if s <= c}
        self._closed_step = min(self._closed_step, c)
        self._step_versions = {s: v for s, v in self._step_versions.items() if s <= c}
        self.trained_step = c
        self._durable = max(self._durable, c)
        self._all_sent.clear()
        self._trained_event.set()
        for inst in self.router.instances.values():
            if inst.version > c + 1:
                inst.version = -1  # holds a ghost: whatever it holds must be loaded again
        self.store.set_incarnation(hello.incarnation)
        self.store.retain({v for v in self.store.versions() if v <= c + 1})
        self.metrics.write(
            "rollback",
            {"incarnation": q.incarnation, "step": c, "rolled_back": len(rolled_back)},
        )
        # A serve restored from its journal holds only version 0 until the trainer publishes its
        # starting version again: the orchestrator must not plan loads of weights not here yet.
        held = [v for v in self.store.versions() if v <= c + 1]
        leases = [f"{gid}/{i}" for gid in rolled_back for i in range(self.group_size)]
        newest = c + 1 if c + 1 in held else max(held, default=0)
        # Right after the queue's roll-back, as `dora.core.rollback` does: nothing in between.
        self.apply(self.orchestrator.rollback(newest, forget=leases))
        self.assigned(assigned)

    def _ghost_tainted(self, newest: int) -> set[str]:
        """Groups holding a token of a version newer than `newest` (partial mode: a request
        resumed on a ghost version): their running leases follow the version that samples them
        now, and a completed group keeps each token's version."""
        tainted = {
            gid
            for lid, lease in self.router.leases.items()
            if lease.version > newest and (gid := lid.rpartition("/")[0]) in self.group_tasks
        }
        for gid, group in self.groups.items():
            if any(s.token_versions().max(initial=-1) > newest for s in group.samples):
                tainted.add(gid)
        return tainted

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
        # A trainer restarted from its last checkpoint (step >= durable) resumes with version
        # durable + 1 or later and does not publish it again: keep those versions.
        keep |= {v for v in self.store.versions() if v > self._durable}
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
        if self._sample_log is not None:
            self._sample_log.write(group)
        reasons = masked_reasons(group.samples)
        if reasons:
            n = sum(reasons.values())
            self.masked_samples += n
            for reason, k in reasons.items():
                self.masked_reasons[reason] = self.masked_reasons.get(reason, 0) + k
            self.metrics.write("masked", {"group": group.id, "samples": n, "reasons": reasons})
        self.assigned(assigned)

    def assigned(self, assigned: list[Assigned] | tuple[Assigned, ...]) -> None:
        for a in assigned:
            # Bounded by the queue's invariant: at most (K + 2) * B groups are assigned and not
            # yet trained, so a full outbox is a bug, not backpressure.
            self._outbox.put_nowait((self.queue.incarnation, a))
        self.changed.set()

    def _check_budget(self) -> None:
        """At a step boundary: end the run here if `learn.max_minutes` ran out."""
        if not self._budget_s or self._budget_hit or self._all_sent.is_set():
            return
        if time.monotonic() - self.started_at >= self._budget_s:
            self._budget_hit = True
            # In a task: the send lock may be held by a send that waits for `_receive`.
            self.spawn(self._stop_for_budget(), name="budget")

    async def _stop_for_budget(self) -> None:
        """`learn.max_minutes` ran out: the run ends with the newest step already closed (the
        trainer trains the steps it has, then finds `Shutdown` where the next step's groups would
        be, checkpoints the last one and stops); nothing more is sent. Under the send lock, so no
        `StepClosed` slips in between the choice of the last step and the `Shutdown`."""
        async with self._send_lock:
            self._end_step = max(self._closed_step, self.trained_step)
            minutes = self.config.learn.max_minutes
            log.info(
                "learn.max_minutes = %g reached: the run ends with step %d (checkpointed, then the "
                "final evaluation)",
                *(minutes, self._end_step),
            )
            self.metrics.write("budget", {"max_minutes": minutes, "last_step": self._end_step})
            with contextlib.suppress(ServerUnavailable):
                reason = f"learn.max_minutes = {minutes:g} reached after step {self._end_step}"
                await self.link.send(
                    Shutdown(reason=reason), timeout_s=self.config.serve.request_timeout_s
                )
            self._all_sent.set()

    async def _send(self) -> None:
        while True:
            incarnation, a = await self._outbox.get()
            async with self._send_lock:
                await self._send_one(incarnation, a)

    async def _send_one(self, incarnation: int, a: Assigned) -> None:
        if self._end_step is not None or incarnation != self.queue.incarnation:
            return  # the run ends at a budget, or this was assigned by a run rolled back since
        group = self.groups[a.group_id]
        if group.incarnation != self.queue.incarnation:  # offered again after a roll-back
            group = msgspec.structs.replace(group, incarnation=self.queue.incarnation)
        if not await self._deliver(AssignedMessage(step=a.step, group=group), incarnation):
            return
        n = self.sent_per_step[a.step] = self.sent_per_step.get(a.step, 0) + 1
        self._step_versions.setdefault(a.step, []).append((a.group_id, a.version))
        if n == self.batch_size:
            if not await self._deliver(StepClosed(step=a.step, num_groups=n), incarnation):
                return
            self._closed_step = max(self._closed_step, a.step)
            self._step_sent(a.step)

    async def _deliver(self, message: AssignedMessage | StepClosed, incarnation: int) -> bool:
        """Send to the trainer. If it is gone, wait (bounded) for a trainer to say hello again:
        the same incarnation (it reconnected) gets the message; a new one (restarted) does not,
        its roll-back re-offers what it needs. False if the message was dropped."""
        timeout_s = self.config.serve.request_timeout_s
        while True:
            if incarnation != self.queue.incarnation:
                return False
            try:
                await self.link.send(message, timeout_s=timeout_s)
                return True
            except ServerUnavailable:
                log.warning("the trainer is gone; waiting up to %g s for it to return", timeout_s)
                self._hello_seen.clear()
                try:
                    async with asyncio.timeout(timeout_s):
                        await self._hello_seen.wait()
                except TimeoutError:
                    raise ServerTimeout(
                        f"the trainer left and no trainer said hello within {timeout_s:g} s"
                    ) from None

    def _step_sent(self, step: int) -> None:
        now = time.monotonic()
        # The trainer waited for this step if it had finished the previous one (or, for step 0,
        # since the start) before the step's last group went out.
        ready_at = self.started_at if step == 0 else self._trained_at.get(step - 1)
        if ready_at is not None:
            self.trainer_wait_s += max(0.0, now - ready_at)
        groups = self._step_versions.pop(step)
        samples = [s for gid, _ in groups for s in self.groups[gid].samples]
        check_not_all_masked(step, samples, env=self.config.env.cls)
        self.queue.sync()
        self.metrics.write(
            "step",
            {
                "step": step,
                "groups": [gid for gid, _ in groups],
                "versions": [v for _, v in groups],
                "staleness": [step - v for _, v in groups],
                "fill_s": now - self._step_started,
            },
        )
        self._step_started = now
        if step == self.num_steps - 1:
            self._all_sent.set()


def v_max(versions: set[int]) -> int:
    return max(versions, default=0)
