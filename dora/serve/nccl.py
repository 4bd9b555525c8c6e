"""Serve's side of `learn.weight_transport = "nccl"`: the instances that switch to a new version
together get it by one NCCL broadcast from trainer rank 0 instead of from the weight store.

Which instances take part. A round is one version and its members, fixed when the first
instance becomes ready to load the version (`InstanceLifecycle` calls `load` once an instance is
empty and its `Load` is due); a version has one round. In `sync`, `one_step_off` and `partial`
every instance switches at publication, so the members are every live instance. In `dora` the
orchestrator moves instances to a new version one by one, as their requests of older versions
end: the members are the instances that switch at once, those with a pending `Load` of the
version and no call in flight when the round forms; an instance that the orchestrator moves later
loads the version from the weight store. The broadcast starts when the last member is ready; one
that is not ready within `serve.weight_load_timeout_s` (busy, dead, replaced) ends the round: the
ready members load from the weight store (`load` returns False). Only the newest version in the
store is broadcast (the one the trainer keeps), and only while the trainer runs; any other load,
and version 0, comes from the weight store as on a CPU.

The group. vLLM's NCCL group is fixed when a server joins it (`/init_weight_transfer_engine`:
rank offset and world size), and a server may join a new one later (vLLM replaces its group). So
serve opens a group for the members of a round, and keeps it for the next rounds while the
members stay the same (in `dora` they often change, and each change opens a new group):
`NcclOpen` tells trainer rank 0 the group's size, rank 0 answers where it listens
(`NcclListening`), every member is told to join there (`dora.vllm.nccl.init_group`), and rank 0
says the group is open (`NcclDone`, version -1). A failed round drops the group; the next
one opens a new one (its `generation` tells the groups apart on both sides).

The moment of a broadcast. `dora.vllm.nccl.publish` pauses and empties each member (the
bookkeeping of every load: a request never runs on weights other than its version), posts
`/start_weight_update`, and once every member has started, sends `NcclBroadcast` to the trainer
and posts `/update_weights` (the names, dtypes and shapes of the version as the store holds it,
in broadcast order) to each member while rank 0 broadcasts; rank 0 answers `NcclDone`; then each
member finishes, resets its prefix cache, is labelled with the version and resumes.

Failure. Anything that goes wrong in a round (a member's route fails, the trainer reports an
error, or the round outlives `serve.weight_load_timeout_s`) is counted (`nccl_fallbacks`, one per
member), logged and written as an `nccl_fallback` record; the members then load the version from
the weight store (a failed broadcast left them paused at version -1, which refuses every pinned
request until that load succeeds). On GPUs a worker still blocked in an NCCL receive would hold
that load too; it then times out and the instance is replaced, as any stuck load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from dora.config import ServeConfig
from dora.core.orchestrator import Mode, Orchestrator
from dora.errors import ConfigError, DoraError, ServerError
from dora.protocol import (
    LearnMessage,
    NcclBroadcast,
    NcclDone,
    NcclListening,
    NcclOpen,
    ServeMessage,
)
from dora.records import NcclFallback
from dora.serve.lifecycle import InstanceLifecycle
from dora.serve.metrics import MetricsLog
from dora.serve.router import Router
from dora.serve.stats import ServeStats
from dora.serve.trainer_link import TrainerLink
from dora.serve.weights import WeightStore
from dora.vllm.client import VllmClient
from dora.vllm.nccl import init_group, publish
from dora.weight_transfer import TransferGroup, UpdateInfo

__all__ = ["NcclLoads", "wire_nccl"]

log = logging.getLogger("dora.serve")

Send = Callable[[ServeMessage], Awaitable[None]]
Members = Callable[[int], tuple[str, ...]]
"""The instances of a round of `version` (module doc), sorted."""


@dataclass
class _Round:
    """The instances loading `version` together (see the module docstring)."""

    version: int
    members: tuple[str, ...]
    deadline: float
    ready: set[str] = field(default_factory=set)
    running: bool = False
    closed: bool = False
    ok: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class NcclLoads:
    """Loads by broadcast, round by round; `load` is the lifecycle's `fast_load`."""

    def __init__(
        self,
        *,
        clients: Callable[[], Mapping[str, object]],
        members: Members,
        store: WeightStore,
        send: Send,
        trainer_up: Callable[[], bool] = lambda: True,
        tensor_parallel: int,
        timeout_s: float,
        stats: ServeStats,
        metrics: MetricsLog,
    ) -> None:
        self._clients = clients
        self._members = members
        self._store = store
        self._send = send
        self._trainer_up = trainer_up
        self._tensor_parallel = tensor_parallel
        self._timeout_s = timeout_s
        self._stats = stats
        self._metrics = metrics
        self._round: _Round | None = None
        self._generation = 0
        self._group: tuple[str, ...] | None = None
        """The members of the open group (None: none is open)."""
        self._waiting: dict[tuple[str, int, int], asyncio.Future[LearnMessage]] = {}

    async def load(self, instance: str, version: int) -> bool:
        """Load `version` onto `instance` (empty, its load due) by broadcast with the other
        members of its round; False when it must load from the weight store instead."""
        store_versions = self._store.versions()
        if version == 0 or not store_versions or version != max(store_versions):
            return False
        if not self._trainer_up():
            return False  # the run's last version, after the trainer stopped: nobody broadcasts
        loop = asyncio.get_running_loop()
        rnd = self._round
        if rnd is None or rnd.version != version:
            members = self._members(version)
            rnd = self._round = _Round(version, members, loop.time() + self._timeout_s)
        if rnd.closed or instance not in rnd.members:
            return False
        rnd.ready.add(instance)
        if rnd.ready == set(rnd.members) and not rnd.running:
            rnd.running = True
            try:
                rnd.ok = await self._run(rnd)
            finally:
                rnd.closed = True
                rnd.settled.set()
            return rnd.ok
        try:
            await asyncio.wait_for(rnd.settled.wait(), max(0.0, rnd.deadline - loop.time()))
        except TimeoutError:
            if rnd.running:  # everyone came: the broadcast is under way, bounded on its own
                await rnd.settled.wait()
            elif not rnd.closed:
                missing = sorted(set(rnd.members) - rnd.ready)
                self._give_up(
                    rnd,
                    f"instances {', '.join(missing)} were not ready for version {version} within "
                    f"{self._timeout_s:g} s; an NCCL broadcast needs every instance of its group",
                )
        return rnd.ok

    def on_message(self, message: LearnMessage) -> None:
        """Trainer rank 0's answer to `NcclOpen` or `NcclBroadcast` (from the trainer link)."""
        if isinstance(message, NcclListening):
            key = ("listening", message.generation, -1)
        elif isinstance(message, NcclDone):
            key = ("done", message.generation, message.version)
        else:
            return
        waiter = self._waiting.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(message)

    # --- one round ------------------------------------------------------------------------------

    async def _run(self, rnd: _Round) -> bool:
        clients = [self._client(i) for i in rnd.members]
        weights = self._store.get(rnd.version)
        try:
            info = UpdateInfo.of(weights.names, weights.dtypes, weights.shapes)
            async with asyncio.timeout(self._timeout_s):
                if self._group != rnd.members:
                    await self._open(rnd.members, clients)
                generation = self._generation
                await publish(
                    clients,
                    rnd.version,
                    info,
                    lambda: self._broadcast(generation, rnd.version),
                    timeout_s=self._timeout_s,
                )
        except (DoraError, TimeoutError, ExceptionGroup, ValueError) as exc:
            self._group = None  # its ranks may be out of step: the next round opens a new one
            self._cancel_waiting()
            self._give_up(rnd, f"the broadcast of version {rnd.version} failed: {_why(exc)}")
            return False
        self._stats.nccl_loads += len(rnd.members)
        return True

    async def _open(self, members: tuple[str, ...], clients: list[VllmClient]) -> None:
        """Open a group of `members` with trainer rank 0."""
        self._group = None
        self._generation += 1
        generation = self._generation
        listening = self._expect("listening", generation, -1)
        opened = self._expect("done", generation, -1)
        await self._send(
            NcclOpen(
                generation=generation,
                instances=len(members),
                tensor_parallel=self._tensor_parallel,
            )
        )
        where = await listening
        assert isinstance(where, NcclListening)
        group = TransferGroup(
            master_address=where.address,
            master_port=where.port,
            instances=len(members),
            tensor_parallel=self._tensor_parallel,
        )
        await init_group(clients, group, lambda: _answered(opened))
        self._group = members
        log.info(
            "NCCL group %d open: trainer rank 0 at %s:%d and %s",
            *(generation, where.address, where.port, ", ".join(members)),
        )

    async def _broadcast(self, generation: int, version: int) -> None:
        """Every member is receiving: ask trainer rank 0 to broadcast, wait for its answer."""
        sent = self._expect("done", generation, version)
        await self._send(NcclBroadcast(generation=generation, version=version))
        await _answered(sent)

    def _expect(self, kind: str, generation: int, version: int) -> asyncio.Future[LearnMessage]:
        waiter: asyncio.Future[LearnMessage] = asyncio.get_running_loop().create_future()
        self._waiting[(kind, generation, version)] = waiter
        return waiter

    def _cancel_waiting(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            waiter.cancel()

    def _client(self, instance: str) -> VllmClient:
        client = self._clients()[instance]
        if not isinstance(client, VllmClient):
            raise ConfigError(
                f"learn.weight_transport = 'nccl' needs vLLM instances; {instance} is a "
                f"{type(client).__name__}"
            )
        return client

    def _give_up(self, rnd: _Round, error: str) -> None:
        """Close `rnd`: its ready members load from the weight store (counted, logged)."""
        rnd.closed, rnd.ok = True, False
        rnd.settled.set()
        instances = sorted(rnd.ready)
        self._stats.nccl_fallbacks += len(instances)
        log.warning(
            "version %d: %s; %s load it from the weight store",
            *(rnd.version, error, ", ".join(instances) or "no instance"),
        )
        self._metrics.write(NcclFallback(version=rnd.version, instances=instances, error=error))


async def _answered(waiter: asyncio.Future[LearnMessage]) -> None:
    """Wait for trainer rank 0's `NcclDone`; `ServerError` with its error if it failed."""
    done = await waiter
    if isinstance(done, NcclDone) and done.error:
        raise ServerError(done.error)


def _why(exc: BaseException) -> str:
    """What went wrong, the leaves of an exception group included."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_why(e) for e in exc.exceptions)
    if isinstance(exc, TimeoutError) and not str(exc):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, DoraError) else str(exc)


def round_members(
    mode: Mode, *, live: Callable[[], Mapping[str, object]], orchestrator: Orchestrator,
    router: Router,
) -> Members:  # fmt: skip
    """Who takes part in a round, by mode (module doc)."""
    if mode is not Mode.DORA:
        return lambda version: tuple(sorted(live()))

    def switching(version: int) -> tuple[str, ...]:
        return tuple(
            sorted(
                i
                for i in live()
                if (load := orchestrator.pending_load(i)) is not None
                and load.version == version
                and router.calls_in_flight(i) == 0
            )
        )

    return switching


def wire_nccl(
    config: ServeConfig,
    *,
    mode: Mode,
    orchestrator: Orchestrator,
    lifecycle: InstanceLifecycle,
    trainer: TrainerLink,
    router: Router,
    store: WeightStore,
    stats: ServeStats,
    metrics: MetricsLog,
) -> NcclLoads:
    """Loads by broadcast for serve's live instances: the lifecycle tries them first, and the
    trainer link hands them rank 0's answers."""

    def live() -> dict[str, object]:
        return {i: c for i, c in router.clients().items() if router.is_alive(i)}

    loads = NcclLoads(
        clients=live,
        members=round_members(mode, live=live, orchestrator=orchestrator, router=router),
        store=store,
        send=trainer.link.send,
        trainer_up=lambda: not trainer.trainer_stopped,
        tensor_parallel=config.vllm_tensor_parallel,
        timeout_s=config.weight_load_timeout_s,
        stats=stats,
        metrics=metrics,
    )
    lifecycle.fast_load = loads.load
    trainer.on_nccl = loads.on_message
    return loads
