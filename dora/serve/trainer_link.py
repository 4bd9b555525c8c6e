"""Serve's side of the trainer link: groups out, weights and acknowledgements in.

Out: completed groups are kept (`group_done`) until the step that consumed them is durable;
what the transfer queue assigns goes out in assignment order (`Assigned`), and `StepClosed` after
the `B`-th group of a step. In: `WeightChunk`/`WeightsReady` fill the weight store; `StepDone`
and `Durable` acknowledge steps; `Hello` (re)connects a trainer; `NcclListening`/`NcclDone`
answer serve's NCCL broadcasts and go to `on_nccl` (`dora.serve.nccl`).

A version `v` is handed to the orchestrator (`publish`) when both `StepDone(v - 1)` arrived and its
weights are complete in the store; instances load it as the orchestrator says (`lifecycle.py`).

A trainer restarted from its checkpoint says `Hello` with a new incarnation and the step it resumes
at: once `refusal` admits it, `on_restart` rolls serve back (`rollback.py`), and this link forgets
what it kept and queued for the lost run (`rewind`). The store keeps every version newer than the
last durable step for this. A trainer that goes away is waited for (bounded) before anything more
is sent.

With `learn.max_minutes`, the first `StepDone` after the budget (on serve's clock) ends the run
early: under the send lock, the newest step already closed becomes the last one, `Shutdown` goes
to the trainer in place of the next step's groups (it trains what it has, checkpoints the last
step and stops), and nothing more is sent. Every wait on the trainer that blocks progress has a
deadline (`serve.request_timeout_s`), and says what it waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec

from dora.config import LearnConfig, RolloutConfig
from dora.core.orchestrator import Orchestrator
from dora.core.transfer_queue import Assigned
from dora.errors import ProtocolError, ServerTimeout, ServerUnavailable
from dora.link import ServeLink
from dora.protocol import Assigned as AssignedMessage
from dora.protocol import (
    Durable,
    Group,
    Hello,
    LearnMessage,
    NcclDone,
    NcclListening,
    Refused,
    Shutdown,
    StepClosed,
    StepDone,
    WeightChunk,
    WeightsReady,
)
from dora.records import Budget, Masked, Trained
from dora.records import Step as StepRecord
from dora.serve.history import check_not_all_masked, masked_reasons
from dora.serve.journal import JournaledQueue, Restored
from dora.serve.metrics import MetricsLog, SampleLog
from dora.serve.placement import Placement
from dora.serve.spawn import Spawner
from dora.serve.stats import ServeStats
from dora.serve.weights import WeightStore, read_folder

__all__ = ["TrainerLink"]

log = logging.getLogger("dora.serve")


class TrainerLink:
    """What serve sends to and hears from the trainer (see the module docstring)."""

    def __init__(
        self,
        rollout: RolloutConfig,
        learn: LearnConfig,
        *,
        request_timeout_s: float,
        env_name: str,
        link: ServeLink,
        queue: JournaledQueue,
        placement: Placement,
        orchestrator: Orchestrator,
        store: WeightStore,
        metrics: MetricsLog,
        stats: ServeStats,
        spawn: Spawner,
        restored: Restored,
        sample_log: SampleLog | None = None,
    ) -> None:
        r = rollout
        self._admit_old_versions = r.admit_old_versions
        self._timeout_s = request_timeout_s
        """Every wait on the trainer that blocks progress (`serve.request_timeout_s`)."""
        self._env_name = env_name
        """The environment (`env.cls`), named when a step's every sample is masked."""
        self.link = link
        self._queue = queue
        self._placement = placement
        self._orchestrator = orchestrator
        self._store = store
        self._metrics = metrics
        self._stats = stats
        self._spawn = spawn
        self._serve_restarted = restored.starts > 0
        """This serve continues a run from its journal."""
        self._sample_log = sample_log
        self._batch_size = r.batch_size
        self._num_steps = learn.steps
        self._max_minutes = learn.max_minutes
        self.groups: dict[str, Group] = dict(restored.groups)
        """Completed groups by id, kept until the step that consumed them is durable."""
        self.trained_step = restored.trained_step if restored.starts else -1
        self.durable = restored.durable_step if restored.starts else -1
        self.sent_per_step: dict[int, int] = {}
        self._outbox: asyncio.Queue[tuple[int, Assigned]] = asyncio.Queue(
            maxsize=(r.staleness + 3) * r.batch_size
        )
        self._step_versions: dict[int, list[tuple[str, int]]] = {}
        self._step_started = time.monotonic()
        self._trained_at: dict[int, float] = {}
        self.trained = asyncio.Event()
        """Set when a step is trained or made durable, or by a roll-back."""
        self.trainer_stopped = False
        self._hello_seen = asyncio.Event()
        self.lost_ready = asyncio.Event()
        """Set once groups lost with a previous serve may be restarted (the trainer said hello)."""
        self.all_sent = asyncio.Event()
        """Every step the run will train is sent (the last of `learn.steps`, or of a budget)."""
        self._send_lock = asyncio.Lock()
        self._closed_step = -1
        """The newest step whose `StepClosed` went out: the trainer will train it."""
        self.end_step: int | None = None
        """The last step of a run cut short by `learn.max_minutes` (None: `learn.steps - 1`)."""
        self._budget_s = learn.max_minutes * 60
        self._budget_hit = False
        self.started_at = time.monotonic()
        self.on_nccl: Callable[[LearnMessage], None] = _unexpected
        """Trainer rank 0's answers about NCCL broadcasts (`dora.serve.nccl`)."""
        self.on_restart: Callable[[Hello], None] = _no_rollback
        """Rolls serve back for a restarted trainer's hello (the composition root sets it)."""

    def start(self) -> None:
        """The run starts now (the clock of `learn.max_minutes` and of the first step's wait)."""
        self.started_at = time.monotonic()

    @property
    def last_step(self) -> int:
        return self._num_steps - 1 if self.end_step is None else self.end_step

    def version_trained_at(self, version: int) -> float | None:
        """When `version` was trained (its `StepDone` arrived), in seconds on the clock of the
        run's records (`time_s`); 0 for the initial weights; None if this serve did not see it."""
        if version == 0:
            return 0.0
        at = self._trained_at.get(version - 1)
        return None if at is None else at - self._metrics.start

    # --- in ------------------------------------------------------------------------------------

    async def receive(self) -> None:
        while True:
            message = await self.link.recv(admit=self.refusal, answer=self.refused)
            match message:
                case Hello():
                    await self._hello(message)
                case WeightChunk():
                    if self._store.on_chunk(message):
                        self.maybe_publish()
                case WeightsReady(path=path) if path and not self._store.has(message.version):
                    chunk = await asyncio.to_thread(read_folder, path, message.version)
                    ready = msgspec.structs.replace(message, path="", num_chunks=1)
                    if self._store.on_chunk(chunk) or self._store.on_ready(ready):
                        self.maybe_publish()
                case WeightsReady():
                    if self._store.on_ready(message):
                        self.maybe_publish()
                case StepDone(step=step, incarnation=inc, metrics=m):
                    if self._queue.on_step_done(step, incarnation=inc):
                        self.trained_step = max(self.trained_step, step)
                        self._trained_at[step] = time.monotonic()
                        self.trained.set()
                        self._metrics.write(Trained(step=step, metrics={**m}))
                        self._check_budget()
                        self.maybe_publish()
                        self._placement.changed.set()
                case Durable(step=step, incarnation=inc):
                    for gid in self._queue.on_durable(step, incarnation=inc):
                        self.groups.pop(gid, None)
                    self._queue.compact(self.groups.keys())
                    if inc == self._queue.incarnation:
                        self.durable = max(self.durable, step)
                        self.trained.set()
                    self.retain_weights()
                case NcclListening() | NcclDone():
                    self.on_nccl(message)
                case Shutdown(reason=reason):
                    if not self._queue.finished or self.trained_step < self._num_steps - 1:
                        raise ProtocolError(f"the trainer shut down before the run ended: {reason}")
                    self.trainer_stopped = True
            await asyncio.sleep(0)  # queued messages (a publication's chunks) one per loop turn

    def refusal(self, hello: Hello) -> str | None:
        """Why serve refuses `hello` (None: it admits it). A trainer's incarnation is one serve
        could have issued: the current one only as the first hello of a fresh run (a fresh
        trainer at step 0), otherwise the next one (a trainer restarted from its checkpoint),
        resuming after a durable step at a step serve filled. Anything else is a stranger, or a
        trainer that is not the run's, and must not move the run."""
        q, inc = self._queue, hello.incarnation
        if inc == q.incarnation:
            if self._serve_restarted and not self.lost_ready.is_set():
                return (
                    f"serve restarted from its journal at incarnation {inc}: a trainer that "
                    "continues this run is restarted with `dora learn --resume`, which takes the "
                    "next incarnation"
                )
            if self.lost_ready.is_set():
                return f"incarnation {inc} already said hello; a restarted trainer takes the next"
            if hello.step != 0:
                return f"a new run's trainer starts at step 0, not {hello.step}"
            return None
        if inc != q.incarnation + 1:
            return (
                f"serve is at incarnation {q.incarnation}: a trainer is that one (a new run) or "
                f"the next (a restart)"
            )
        durable, filled = q.durable_step, q.step
        if not durable < hello.step <= filled:
            return (
                f"a restarted trainer resumes after the durable step {durable} and at most at "
                f"step {filled} (the step being filled), not at step {hello.step}"
            )
        return None

    def refused(self, hello: Hello, why: str) -> Refused:
        """The answer to a hello with the run's token that `refusal` refused."""
        return Refused(reason=why, incarnation=self._queue.incarnation)

    async def _hello(self, hello: Hello) -> None:
        """A hello the link admitted (`refusal`): a restart rolls back, then serve answers."""
        q = self._queue
        if hello.incarnation > q.incarnation:
            self.on_restart(hello)
        self.lost_ready.set()
        log.info("trainer connected (incarnation %d, step %d)", hello.incarnation, hello.step)
        self._hello_seen.set()
        try:
            await self.link.send(Hello(role="serve", incarnation=q.incarnation, step=q.step))
        except ServerUnavailable:
            # It said hello and left before the answer (a trainer resumed past its last step has
            # nothing to train). Not an error: a send that needs a trainer waits for the next
            # hello (`_deliver`), and a finished run needs none.
            log.info("the trainer left before serve answered its hello")

    def rewind(self, step: int, rolled_back: list[str]) -> None:
        """A roll-back to the checkpoint of `step`: the groups it removed are forgotten, the
        assignments of the lost run not sent yet are dropped, and the steps after `step` go out
        again."""
        for gid in rolled_back:
            self.groups.pop(gid, None)
        while not self._outbox.empty():
            self._outbox.get_nowait()
        self.sent_per_step = {s: n for s, n in self.sent_per_step.items() if s <= step}
        self._closed_step = min(self._closed_step, step)
        self._step_versions = {s: v for s, v in self._step_versions.items() if s <= step}
        self.trained_step = step
        self.durable = max(self.durable, step)
        self.all_sent.clear()
        self.trained.set()

    def holds(self, gid: str) -> bool:
        """Whether the completed group `gid` is kept here (until its step is durable)."""
        return gid in self.groups

    def groups_sampled_above(self, newest: int) -> set[str]:
        """The completed groups holding a token of a version newer than `newest`."""
        return {
            gid
            for gid, group in self.groups.items()
            if any(s.token_versions().max(initial=-1) > newest for s in group.samples)
        }

    def maybe_publish(self) -> None:
        """Hand the newest published version whose weights are complete to the orchestrator."""
        v = self._queue.published_version
        if self._queue.finished:
            return  # every step is filled: nothing will be sampled by a newer version
        if v > self._orchestrator.newest and self._store.has(v):
            self._placement.apply(self._orchestrator.publish(v))
            self.retain_weights()

    def publish_final(self) -> int:
        """The final version, handed to the orchestrator so an instance loads it (it never was:
        every step was filled before it was published); returns it."""
        final = self._queue.published_version
        if not self._store.has(final):
            final = self._orchestrator.newest
        if final > self._orchestrator.newest:
            self._placement.apply(self._orchestrator.publish(final))
            self.retain_weights()
        return final

    def retain_weights(self) -> None:
        keep = {0, self._orchestrator.newest, self._queue.published_version}
        # A trainer restarted from its last checkpoint (step >= durable) resumes with version
        # durable + 1 or later. It publishes its starting version again, so this keeps more than
        # a restart needs (the versions the queue and the orchestrator use would do).
        keep |= {v for v in self._store.versions() if v > self.durable}
        keep |= set(self._queue.version_counts())
        keep |= set(self._orchestrator.live())
        keep |= {i.version for i in self._orchestrator.instances() if i.version is not None}
        if self._admit_old_versions:
            q = self._queue
            keep |= set(range(max(0, q.step - q.max_staleness), max(keep, default=0) + 1))
        self._store.retain(keep)

    # --- out -----------------------------------------------------------------------------------

    def group_done(self, group: Group, assigned: list[Assigned]) -> None:
        """A group completed (or was masked): keep it, queue what the completion assigned."""
        self.groups[group.id] = group
        self._stats.completed += 1
        if self._sample_log is not None:
            self._sample_log.write(group)
        reasons = masked_reasons(group.samples)
        if reasons:
            n = self._stats.add_masked(reasons)
            self._metrics.write(Masked(group=group.id, samples=n, reasons=reasons))
        self.assigned(assigned)

    def assigned(self, assigned: list[Assigned] | tuple[Assigned, ...]) -> None:
        for a in assigned:
            # Bounded by the queue's invariant: at most (K + 2) * B groups are assigned and not
            # yet trained, so a full outbox is a bug, not backpressure.
            self._outbox.put_nowait((self._queue.incarnation, a))
        self._placement.changed.set()

    def _check_budget(self) -> None:
        """At a step boundary: end the run here if `learn.max_minutes` ran out."""
        if not self._budget_s or self._budget_hit or self.all_sent.is_set():
            return
        if time.monotonic() - self.started_at >= self._budget_s:
            self._budget_hit = True
            # In a task: the send lock may be held by a send that waits for `receive`.
            self._spawn(self._stop_for_budget(), name="budget")

    async def _stop_for_budget(self) -> None:
        """`learn.max_minutes` ran out: the run ends with the newest step already closed (the
        trainer trains the steps it has, then finds `Shutdown` where the next step's groups would
        be, checkpoints the last one and stops); nothing more is sent. Under the send lock, so no
        `StepClosed` slips in between the choice of the last step and the `Shutdown`."""
        async with self._send_lock:
            self.end_step = max(self._closed_step, self.trained_step)
            minutes = self._max_minutes
            log.info(
                "learn.max_minutes = %g reached: the run ends with step %d (checkpointed, then the "
                "final evaluation)",
                *(minutes, self.end_step),
            )
            self._metrics.write(Budget(max_minutes=minutes, last_step=self.end_step))
            with contextlib.suppress(ServerUnavailable):
                reason = f"learn.max_minutes = {minutes:g} reached after step {self.end_step}"
                await self.link.send(Shutdown(reason=reason), timeout_s=self._timeout_s)
            self.all_sent.set()

    async def send(self) -> None:
        while True:
            incarnation, a = await self._outbox.get()
            async with self._send_lock:
                await self._send_one(incarnation, a)
            # A step's groups are assigned at once, and a send that need not wait (journal
            # written, socket ready) never yields: without a turn here a step's hundreds of
            # groups would be encoded and sent in one loop iteration, holding up everything else.
            # (`receive` takes the same turn between the messages it finds already queued.)
            await asyncio.sleep(0)

    async def _send_one(self, incarnation: int, a: Assigned) -> None:
        q = self._queue
        if self.end_step is not None or incarnation != q.incarnation:
            return  # the run ends at a budget, or this was assigned by a run rolled back since
        group = self.groups[a.group_id]
        if group.incarnation != q.incarnation:  # offered again after a roll-back
            group = msgspec.structs.replace(group, incarnation=q.incarnation)
        await q.written()  # the trainer never holds a group that the journal could lose
        if not await self._deliver(AssignedMessage(step=a.step, group=group), incarnation):
            return
        n = self.sent_per_step[a.step] = self.sent_per_step.get(a.step, 0) + 1
        self._step_versions.setdefault(a.step, []).append((a.group_id, a.version))
        if n == self._batch_size:
            if not await self._deliver(StepClosed(step=a.step, num_groups=n), incarnation):
                return
            self._closed_step = max(self._closed_step, a.step)
            self._step_sent(a.step)

    async def _deliver(self, message: AssignedMessage | StepClosed, incarnation: int) -> bool:
        """Send to the trainer. If it is gone, wait (bounded) for a trainer to say hello again:
        the same incarnation (it reconnected) gets the message; a new one (restarted) does not,
        its roll-back re-offers what it needs. False if the message was dropped."""
        timeout_s = self._timeout_s
        while True:
            if incarnation != self._queue.incarnation:
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
            self._stats.trainer_wait_s += max(0.0, now - ready_at)
        groups = self._step_versions.pop(step)
        samples = [s for gid, _ in groups for s in self.groups[gid].samples]
        check_not_all_masked(step, samples, env=self._env_name)
        self._queue.sync()
        self._metrics.write(
            StepRecord(
                step=step,
                groups=[gid for gid, _ in groups],
                versions=[v for _, v in groups],
                staleness=[step - v for _, v in groups],
                fill_s=now - self._step_started,
            )
        )
        self._step_started = now
        if step == self._num_steps - 1:
            self.all_sent.set()

    # --- the end -------------------------------------------------------------------------------

    async def wait_durable(self) -> int:
        """Wait until the last step is durable (the trainer checkpoints it before it stops: a
        trainer that dies before that resumes and needs the groups serve still holds); bounded by
        `serve.request_timeout_s` per wait. Returns the last step."""
        timeout_s = self._timeout_s
        last = self.last_step
        while self.durable < last:
            await self.all_sent.wait()
            last = self.last_step
            if self.durable < last:
                log.info(
                    "every step is sent; waiting up to %g s for the trainer to make step %d "
                    "durable (trained: %d, durable: %d)",
                    *(timeout_s, last, self.trained_step, self.durable),
                )
            try:
                async with asyncio.timeout(timeout_s):
                    # A roll-back clears `all_sent` (and wakes this): the steps go out again.
                    while self.durable < last and self.all_sent.is_set():
                        self.trained.clear()
                        await self.trained.wait()
                        last = self.last_step
            except TimeoutError:
                log.warning(
                    "the trainer did not make step %d durable within %g s (trained: %d)",
                    *(last, timeout_s, self.trained_step),
                )
                break
        return last

    async def shutdown(self) -> None:
        """Tell the trainer the run is over, unless it stopped or a budget already told it."""
        if not self.trainer_stopped and self.end_step is None:
            # The trainer may have finished and closed its end first: nothing left to tell it.
            with contextlib.suppress(ServerUnavailable):
                await self.link.send(
                    Shutdown(reason="rollout finished"),
                    timeout_s=self._timeout_s,
                )


def _unexpected(message: LearnMessage) -> None:
    raise ProtocolError(
        f"the trainer sent {type(message).__name__}, but learn.weight_transport is not 'nccl' "
        "in dora serve's config"
    )


def _no_rollback(hello: Hello) -> None:
    raise AssertionError(f"no roll-back wired to take {hello}")
