"""The rollout side of a run: serve's parts, wired together and run in one event loop.

`Rollout` is the composition root. It builds the parts, hands each the others it needs and the
settings it reads (no part receives `Rollout` or the whole config), sets every callback between
them, and runs their loops in one `asyncio.TaskGroup`:
- the transfer queue (`dora.core.transfer_queue`, the staleness gate, journaled: `journal.py`)
  and the orchestrator (`dora.core.orchestrator`, versions -> instances), both driven unchanged
  and timed (`coretime.py`);
- `Placement` (`placement.py`): the orchestrator's plan and the router's leases (`router.py`) in
  step; the dispatcher and the evaluator open and end leases through it, and every orchestrator
  action is carried out by it;
- `InstanceLifecycle` (`lifecycle.py`): weight loads, failed and unresponsive instances, and their
  replacements; what each instance holds is recorded in `InstanceVersions` (`versions.py`);
- `TrainerLink` (`trainer_link.py`): groups out, weights and acknowledgements in, a
  `learn.max_minutes` budget; a restarted trainer's hello goes to `Rollback` (`rollback.py`),
  which rolls the queue, the running groups (`RunningGroups`, `running.py`), the trainer link,
  the instances' versions, the weight store and the orchestrator back together;
- the dispatcher (admission and episodes, `dispatcher.py`), the metrics ticker (`metrics.py`),
  and evaluation while training (`evaluate.py`), when `data.eval_source` is set;
- `ServeStats` (`stats.py`): every counter, shared by the parts that count;
- on one machine, CPU priority by deadline for the engine processes it started
  (`cpu_priority.py`, `serve.cpu_priority`).

Event flow. Every state change that can unblock admission (a group completes, a lease ends, a
version loads, a step is acknowledged) sets `Placement.changed`; the dispatcher waits on it, never
polls. Admission binds groups to the newest *published* version once an instance holds it, and
waits while it loads (bind late; docs/scheduling.md says why not the previous version).

Faults. Every queue operation and every completed group's samples go to the run's journal
(`journal.py`); a `dora serve` started on a run directory that holds one replays it: completed
groups are offered to the (restarted) trainer again, and groups whose episodes died with the
previous process are restarted at the newest version once the trainer has said hello and rolled
back (`TransferQueue.restart`, counted). Instances that die are replaced (`lifecycle.py`).

The run ends when every step is filled and sent, the trainer made the last step durable (`Durable`
after its final checkpoint; bounded wait: a trainer that dies before it resumes and trains the last
steps again from the groups serve holds), the final version is evaluated (loaded for this once
every step is trained), and `Shutdown` is sent. A run cut short by `learn.max_minutes` ends the
same way at its last step (groups admitted for later steps are left unassigned: counted in the
summary).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dora.config import DoraConfig, ServeConfig
from dora.core.orchestrator import Mode, Orchestrator
from dora.env import Env, PromptStream, Task
from dora.episode import ChatRenderer
from dora.instance import common_capabilities
from dora.link import ServeLink
from dora.records import Restore, ServeStart
from dora.serve.console import StepLines
from dora.serve.coretime import CoreClock
from dora.serve.cpu_priority import CpuPriority
from dora.serve.dispatcher import Dispatcher, episode_limits, turn_max_tokens
from dora.serve.evaluate import Evaluator
from dora.serve.history import History, read_history
from dora.serve.instances import InstanceHandle
from dora.serve.journal import JournaledQueue, Restored
from dora.serve.lifecycle import InstanceLifecycle, Replace
from dora.serve.metrics import MetricsLog, Progress, RolloutReport, SampleLog, Ticker
from dora.serve.placement import Placement

if TYPE_CHECKING:
    from dora.serve.runner_processes import LocalRunners
    from dora.serve.runners import RunnerHub
from dora.serve.rollback import Rollback
from dora.serve.router import Router
from dora.serve.running import RunningGroups
from dora.serve.snapshots import Snapshots
from dora.serve.spawn import Spawner
from dora.serve.stats import ServeStats
from dora.serve.trainer_link import TrainerLink
from dora.serve.turns import Turns
from dora.serve.versions import InstanceVersions
from dora.serve.weights import WeightStore
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
        tasks: PromptStream,
        env_factory: Callable[[], Env],
        renderer: ChatRenderer,
        eval_tasks: list[Task] | None = None,
        progress: bool = False,
        replace_instance: Replace | None = None,
        prompts_skipped: int = 0,
        eval_prompts_skipped: int = 0,
        sample_log: SampleLog | None = None,
    ) -> None:
        self.config = config
        self._instances = instances
        self._capabilities = common_capabilities([h.client for h in instances])
        self.stats = ServeStats(
            prompts_skipped=prompts_skipped, eval_prompts_skipped=eval_prompts_skipped
        )
        # the orchestration overhead: time spent inside the queue and the orchestrator
        self.core = CoreClock()
        self.queue = self.core.wrap(_journaled_queue(config, run_dir))
        self.metrics = _metrics_log(config, run_dir)
        self.spawn = Spawner()
        self.placement = self._placement(config)
        self.versions = InstanceVersions(
            multi_version=config.model.lora.rank > 0 and self._capabilities.lora_versions
        )
        self.store = WeightStore()
        self.store.add_path(0, model_dir)
        self.lifecycle = self._instance_lifecycle(config, replace_instance)
        restored = self.queue.restore()  # before the dispatcher, which continues the prompt stream
        self.stats.completed = len(restored.groups)
        self.history = read_history(self.metrics.path) if restored.starts else History()
        """What earlier serves of this run recorded (empty unless this serve is a restart)."""
        self.restored = restored
        self.trainer = self._trainer_link(config, link, restored, sample_log)
        self.running = RunningGroups(
            group_size=config.rollout.group_size, close_lease=self.placement.drop
        )
        self.trainer.on_restart = self._rollback(config)
        if config.learn.weight_transport == "nccl":
            self._load_by_broadcast(config)
        self.runners = self._runner_hub(config, run_dir)
        self.dispatcher = Dispatcher(
            config.rollout,
            limits=episode_limits(config),
            trainer_timeout_s=config.serve.request_timeout_s,
            queue=self.queue,
            placement=self.placement,
            orchestrator=self.orchestrator,
            turns=self.turns,
            trainer=self.trainer,
            restored=restored,
            running=self.running,
            stats=self.stats,
            spawn=self.spawn,
            tasks=tasks,
            env_factory=env_factory,
            renderer=renderer,
            runners=self.runners[0] if self.runners is not None else None,
        )
        self.evaluator = (
            self._evaluate_while_training(config, eval_tasks, env_factory, renderer)
            if eval_tasks
            else None
        )
        self._progress = Progress(total_steps=config.learn.steps) if progress else None
        self._snapshots, self.ticker = self._metrics_ticker(config, link)
        if restored.starts:
            self._log_restore()
        self._cpu_priority = _cpu_priority(config.serve, self._instances)

    def _placement(self, config: DoraConfig) -> Placement:
        """The router and the orchestrator (the parts that need one get it from here), and the
        placement that keeps them in step; requests move with their KV cache where the config
        asks for it and every instance can."""
        self.turns = Turns()
        self.router = Router(
            turns=self.turns,
            # with runners, a move resubmits: an export would have to cross to the runner
            kv_migration=config.serve.kv_migration
            and self._capabilities.kv_migration
            and not config.serve.runners,
            control_timeout_s=config.serve.weight_load_timeout_s,
            stats=self.stats,
            pin_versions=config.rollout.mode != "inflight",
            sessions=self._capabilities.sessions,
        )
        self.orchestrator = self.core.wrap(Orchestrator(mode=Mode(config.rollout.mode)))
        return Placement(self.orchestrator, self.router, metrics=self.metrics, spawn=self.spawn)

    def _runner_hub(
        self, config: DoraConfig, run_dir: Path
    ) -> tuple[RunnerHub, LocalRunners] | None:
        """With `serve.runners`, the runners' port and serve's own runner processes."""
        if not config.serve.runners:
            return None
        from dora.serve.runner_processes import LocalRunners, local_runner_names
        from dora.serve.runners import RunnerHub

        serve = config.serve
        hub = RunnerHub(
            serve,
            router=self.router,
            stats=self.stats,
            spawn=self.spawn,
            metrics=self.metrics,
            expected=local_runner_names(serve.runners),
        )
        print(f"dora serve: episode runners on {hub.address}", flush=True)
        return hub, LocalRunners(config, hub=hub, run_dir=run_dir)

    def _trainer_link(
        self, config: DoraConfig, link: ServeLink, restored: Restored, sample_log: SampleLog | None
    ) -> TrainerLink:
        return TrainerLink(
            config.rollout,
            config.learn,
            request_timeout_s=config.serve.request_timeout_s,
            env_name=config.env.cls,
            link=link,
            queue=self.queue,
            placement=self.placement,
            orchestrator=self.orchestrator,
            store=self.store,
            metrics=self.metrics,
            stats=self.stats,
            spawn=self.spawn,
            restored=restored,
            sample_log=sample_log,
        )

    def _rollback(self, config: DoraConfig) -> Rollback:
        """The roll-back for a restarted trainer, over the parts it rolls back together."""
        return Rollback(
            group_size=config.rollout.group_size,
            queue=self.queue,
            trainer=self.trainer,
            running=self.running,
            placement=self.placement,
            orchestrator=self.orchestrator,
            versions=self.versions,
            store=self.store,
            metrics=self.metrics,
        )

    def _load_by_broadcast(self, config: DoraConfig) -> None:
        """Versions reach the instances that switch to them by an NCCL broadcast from trainer
        rank 0, the weight store being the fallback (`dora.serve.nccl`)."""
        from dora.serve.nccl import wire_nccl

        wire_nccl(
            config.serve,
            mode=Mode(config.rollout.mode),
            orchestrator=self.orchestrator,
            lifecycle=self.lifecycle,
            trainer=self.trainer,
            router=self.router,
            store=self.store,
            stats=self.stats,
            metrics=self.metrics,
        )

    def _instance_lifecycle(self, config: DoraConfig, replace: Replace | None) -> InstanceLifecycle:
        """The instance lifecycle, wired as the one that carries out loads and unloads and hears
        of unreachable instances."""
        lifecycle = InstanceLifecycle(
            config.serve,
            placement=self.placement,
            orchestrator=self.orchestrator,
            router=self.router,
            versions=self.versions,
            queue=self.queue,
            store=self.store,
            metrics=self.metrics,
            stats=self.stats,
            spawn=self.spawn,
            replace=replace,
            in_flight=config.rollout.mode == "inflight",
        )
        self.placement.on_load = lifecycle.load
        self.placement.on_unload = lifecycle.unload
        self.router.on_failure = lifecycle.failed
        return lifecycle

    def _metrics_ticker(self, config: DoraConfig, link: ServeLink) -> tuple[Snapshots, Ticker]:
        """What a metrics line reads (`Snapshots`) and the loop that writes one every
        `log.metrics_every_s`."""
        snapshots = Snapshots(
            mode=config.rollout.mode,
            queue=self.queue,
            orchestrator=self.orchestrator,
            router=self.router,
            trainer=self.trainer,
            store=self.store,
            stats=self.stats,
            core=self.core,
            link=link,
            evals=lambda: self.evaluator.history if self.evaluator is not None else [],
            history=self.history,
        )
        ticker = Ticker(
            self.metrics,
            snapshots.take,
            every_s=config.log.metrics_every_s,
            progress=self._progress,
        )
        return snapshots, ticker

    def _evaluate_while_training(
        self,
        config: DoraConfig,
        tasks: list[Task],
        env_factory: Callable[[], Env],
        renderer: ChatRenderer,
    ) -> Evaluator:
        """The evaluator, woken by placement changes and by each newest version that loads."""
        evaluator = Evaluator(
            config.data,
            max_tokens=turn_max_tokens(config.rollout),
            limits=episode_limits(config),
            max_running=config.serve.max_running,
            placement=self.placement,
            newest_loaded=lambda: self.queue.newest_version,
            trained_at=self.trainer.version_trained_at,
            metrics=self.metrics,
            spawn=self.spawn,
            tasks=tasks,
            env_factory=env_factory,
            renderer=renderer,
            runners=self.runners[0] if self.runners is not None else None,
        )
        self.placement.listeners.append(evaluator.wake)
        self.lifecycle.on_newest_loaded = self._evaluate_loaded
        return evaluator

    async def run(self) -> RolloutReport:
        starts = self.restored.starts
        self.trainer.start()
        self.metrics.write(ServeStart(serve_start=starts + 1, unix_time=time.time()))
        try:
            async with asyncio.TaskGroup() as tg:
                self.spawn.open(tg)
                for handle in self._instances:
                    self.lifecycle.add(handle)
                tg.create_task(self.trainer.receive(), name="trainer-receive")
                tg.create_task(self.trainer.send(), name="trainer-send")
                tg.create_task(self.dispatcher.run(), name="dispatcher")
                if self.runners is not None:
                    tg.create_task(self.runners[0].run(), name="runners")
                    tg.create_task(self.runners[1].run(), name="runner-processes")
                tg.create_task(self.ticker.run(), name="metrics")
                if self.config.serve.health_timeout_s > 0:
                    tg.create_task(self.lifecycle.health().run(), name="health")
                if self._cpu_priority is not None:
                    tg.create_task(
                        self._cpu_priority.run(self.router.background), name="cpu-priority"
                    )
                tg.create_task(self._finish(), name="finish")
        except* _RunComplete:
            pass
        finally:
            self.spawn.open(None)
            if self._progress is not None:
                self._progress.close()
            report = self._snapshots.report(
                restored_starts=starts,
                max_lag_ms=self.ticker.max_lag_ms,
                max_stall_ms=self.ticker.max_stall_ms,
            )
            if self._cpu_priority is not None:
                report.extra["cpu_priority_switches"] = self._cpu_priority.switches
            if self.runners is not None:
                self.runners[0].close()
                for name, n in self.runners[0].episodes_by_runner.items():
                    report.extra[f"runner_episodes_{name}"] = n
                report.extra["runner_restarts"] = self.runners[1].restarts
            self.metrics.write(report)
            self.metrics.close()
            self.queue.close()
        return report

    def _log_restore(self) -> None:
        """Say what the journal of a `dora serve` that ran on this run directory before held."""
        restored, q = self.restored, self.queue
        acct = q.accounting()
        log.warning(
            "restored from the journal (start %d): step %d, %d groups held, %d to restart",
            restored.starts + 1,
            q.step,
            len(restored.groups),
            len(restored.lost),
        )
        self.metrics.write(
            Restore(
                serve_start=restored.starts + 1,
                step=q.step,
                incarnation=q.incarnation,
                groups_held=len(restored.groups),
                lost=len(restored.lost),
                admitted=acct.admitted,
                consumed=acct.consumed,
                rolled_back=acct.rolled_back,
            )
        )

    def _evaluate_loaded(self, version: int) -> None:
        """An instance holds the newest loaded version: the evaluator may evaluate it. In a
        restored serve only after the trainer's roll-back: before it, the journal's newest version
        is weights no instance has."""
        assert self.evaluator is not None
        if not self.restored.starts or self.trainer.lost_ready.is_set():
            self.evaluator.on_loaded(version)

    async def _finish(self) -> None:
        """Wait for the last step to be durable, evaluate the final version, say `Shutdown`."""
        last = await self.trainer.wait_durable()
        if self.evaluator is not None:
            log.info("the run ends with step %d; evaluating the final version", last)
            timeout_s = self.config.serve.request_timeout_s
            final = self.trainer.publish_final()
            try:
                await self.evaluator.finish(final, timeout_s=timeout_s)
            except TimeoutError:
                log.warning("the final evaluation (v%d) did not finish in %g s", final, timeout_s)
        await self.trainer.shutdown()
        self.ticker.emit(0.0)
        raise _RunComplete


def _journaled_queue(config: DoraConfig, run_dir: Path) -> JournaledQueue:
    """The transfer queue of `rollout`'s settings, journaled in the run directory."""
    r = config.rollout
    return JournaledQueue(
        run_dir,
        groups_per_step=r.batch_size,
        max_staleness=r.staleness,
        num_steps=config.learn.steps,
        max_retries=r.max_retries if r.on_env_error == "retry" else 0,
        admit_old_versions=r.admit_old_versions,
    )


def _metrics_log(config: DoraConfig, run_dir: Path) -> MetricsLog:
    """metrics.jsonl, the tracker `log.tracker` names and the console's step lines."""
    console = None
    if config.log.console_every:
        console = StepLines(every=config.log.console_every, total_steps=config.learn.steps)
    return MetricsLog(run_dir, tracking=open_tracking(config, run_dir), console=console)


def _cpu_priority(config: ServeConfig, instances: list[InstanceHandle]) -> CpuPriority | None:
    """CPU priority by deadline for the engine processes serve started, where it may apply."""
    local = sum(handle.set_background is not None for handle in instances)
    if not config.cpu_priority or not local:
        return None
    log.info("serve.cpu_priority: %d engine processes, the oldest version's first", local)
    return CpuPriority()
