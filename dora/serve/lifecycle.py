"""The lifetime of serve's instances: weight loads, failures, replacements.

A `Load` from the orchestrator runs in its own task, serialised per instance, after the
instance's last call has returned (`Router.wait_idle`); the instance then holds the version, and
the transfer queue learns of it (`on_version_loaded`) when the first instance holds it. On a
multi-version instance (the embedded engine with LoRA: versions are adapters over one base) a
`Load` adds the version beside the others at once, with its calls still running (the engine's
"drain" mode does not wait for an adapter, and keeps every running row on its own version), and
an `Unload` drops a version no lease needs (`/control/unload_weights`; a refusal is logged, the
engine's own `max_adapters` bound still holds). A weight
load that times out is retried `serve.weight_load_retries` times; then the instance counts as dead.
An instance that dies (unreachable, a stuck load, or past its health deadline) gets no more work:
its leases continue on instances of their version, or are parked until one has room; it is
replaced (when the pool can start instances: `replace`), at most `serve.max_instance_restarts`
times in a run, and the replacement loads the version the orchestrator gives it from the weight
store.

In mode `inflight` a `Load` does not wait for the instance's calls: the engine loads between two
decode steps ("keep") and its running requests go on under the new weights with their KV cache.
It waits only for the evaluation leases on the instance (`Router.wait_unpinned`), so that a
held-out evaluation is of the one version its record names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from dora.config import ServeConfig
from dora.core.orchestrator import Load, Orchestrator, Unload
from dora.errors import ServerError, ServerTimeout, ServerUnavailable
from dora.records import (
    InstanceFailed,
    InstanceRestarted,
    InstanceRestartFailed,
    InstanceUnresponsive,
    WeightLoad,
    WeightLoadTimeout,
)
from dora.serve.health import HealthWatch
from dora.serve.instances import InstanceHandle
from dora.serve.journal import JournaledQueue
from dora.serve.metrics import MetricsLog
from dora.serve.placement import Placement
from dora.serve.router import Router
from dora.serve.spawn import Spawner
from dora.serve.stats import ServeStats
from dora.serve.versions import InstanceVersions
from dora.serve.weights import WeightStore

__all__ = ["InstanceLifecycle", "Replace"]

log = logging.getLogger("dora.serve")

Replace = Callable[[str], Awaitable[InstanceHandle]]
"""Start an instance in place of the dead one named."""


class InstanceLifecycle:
    """Loads, failures and replacements of serve's instances (see the module docstring)."""

    def __init__(
        self,
        config: ServeConfig,
        *,
        placement: Placement,
        orchestrator: Orchestrator,
        router: Router,
        versions: InstanceVersions,
        queue: JournaledQueue,
        store: WeightStore,
        metrics: MetricsLog,
        stats: ServeStats,
        spawn: Spawner,
        replace: Replace | None = None,
        in_flight: bool = False,
    ) -> None:
        self._config = config
        self._multi_version = versions.multi_version
        self._in_flight = in_flight
        self._placement = placement
        self._router = router
        self._versions = versions
        self._orchestrator = orchestrator
        self._queue = queue
        self._store = store
        self._metrics = metrics
        self._stats = stats
        self._spawn = spawn
        self._replace_instance = replace
        self._load_locks: dict[str, asyncio.Lock] = {}
        self.on_newest_loaded: Callable[[int], None] = lambda version: None
        """Called when an instance now holds the queue's newest loaded version."""
        self.fast_load: Callable[[str, int], Awaitable[bool]] | None = None
        """Tried before the weight store: loads `(instance, version)` another way, or returns
        False (`dora.serve.nccl`: a broadcast from trainer rank 0)."""

    def add(self, handle: InstanceHandle) -> None:
        """A new instance (it holds version 0); the orchestrator gives it work."""
        self._router.add_instance(handle.id, handle.client, set_background=handle.set_background)
        self._versions.add(handle.id)
        self._load_locks[handle.id] = asyncio.Lock()
        capacity = self._config.max_running
        self._placement.apply(
            self._orchestrator.add_instance(
                handle.id, capacity=capacity, multi_version=self._multi_version
            )
        )

    def health(self) -> HealthWatch:
        """The health watch of the live instances."""
        return HealthWatch(
            targets=lambda: {
                i: client
                for i, client in self._router.clients().items()
                if i not in self._stats.instances_failed
            },
            on_dead=self.unresponsive,
            timeout_s=self._config.health_timeout_s,
            answered_at=self._router.answered_at,
        )

    # --- failures ------------------------------------------------------------------------------

    def failed(self, instance: str) -> None:
        """An instance is unreachable: its leases continue on instances of their version (or are
        parked until one has room); it gets no more work."""
        if instance in self._stats.instances_failed:
            return
        self._stats.instances_failed.add(instance)
        log.warning("instance %s is unreachable; moving its requests", instance)
        self._metrics.write(InstanceFailed(instance=instance))
        self._placement.apply(self._orchestrator.remove_instance(instance))
        self._replace(instance)

    def unresponsive(self, instance: str, error: str) -> None:
        """An instance missed its health deadline (it may hang rather than be gone): dead, like
        one that is unreachable, and the calls still waiting on it are cut and resubmitted."""
        if instance in self._stats.instances_failed:
            return
        self._metrics.write(InstanceUnresponsive(instance=instance, error=error))
        self.failed(instance)
        cut = self._router.cut(instance)
        log.warning("instance %s missed its health deadline; %d calls cut", instance, cut)

    def _replace(self, instance: str) -> None:
        """Start a replacement for a dead instance, within `serve.max_instance_restarts`."""
        limit = self._config.max_instance_restarts
        if self._replace_instance is not None and self._stats.instance_restarts < limit:
            self._stats.instance_restarts += 1
            self._spawn(self._start_replacement(instance), name=f"replace-{instance}")
        elif not self._orchestrator.instances():
            raise ServerUnavailable(
                f"every inference instance is gone (the last: {instance}); "
                f"{self._stats.instance_restarts} of serve.max_instance_restarts = {limit} "
                "replacements were used"
            )

    async def _start_replacement(self, instance: str) -> None:
        assert self._replace_instance is not None
        try:
            handle = await self._replace_instance(instance)
        except (ServerUnavailable, ServerTimeout) as exc:
            log.warning("replacing instance %s failed: %s", instance, exc)
            self._metrics.write(InstanceRestartFailed(instance=instance, error=str(exc)))
            self._replace(instance)
            return
        log.warning("instance %s replaces %s", handle.id, instance)
        self._metrics.write(InstanceRestarted(instance=handle.id, replaces=instance))
        self.add(handle)

    # --- loads ---------------------------------------------------------------------------------

    def load(self, load: Load) -> None:
        """Carry out a `Load`: at once if the instance already holds the version (every instance
        starts with version 0), else in a task."""
        held = self._versions.holds(load.instance, load.version)
        if held and not self._load_locks[load.instance].locked():
            self._loaded(load)
        else:
            self._spawn(self._load(load), name=f"load-{load.instance}-v{load.version}")

    def unload(self, unload: Unload) -> None:
        """Carry out an `Unload`: the instance stops counting as holding the version at once
        (`InstanceVersions`); the engine drops the adapter in a task, after any load of the
        instance under way."""
        if self._router.has(unload.instance):
            self._versions.dropped(unload.instance, unload.version)
            self._spawn(self._unload(unload), name=f"unload-{unload.instance}-v{unload.version}")

    async def _unload(self, unload: Unload) -> None:
        instance, client = unload.instance, self._router.client(unload.instance)
        if not client.capabilities.lora_versions or not self._router.is_alive(instance):
            return
        async with self._load_locks[instance]:
            try:
                timeout_s = self._config.weight_load_timeout_s
                await client.unload_weights(unload.version, timeout_s=timeout_s)
                log.debug("instance %s dropped version %d", instance, unload.version)
            except (ServerError, ServerTimeout) as exc:
                log.warning("instance %s kept version %d: %s", instance, unload.version, exc)

    def _loaded(self, load: Load) -> None:
        if not self._orchestrator.is_pending(load):
            return  # superseded during the load (another Load, a roll-back, the instance died)
        self._queue.on_version_loaded(load.version)
        self._placement.apply(self._orchestrator.on_loaded(load))
        if load.version == self._queue.newest_version:
            self.on_newest_loaded(load.version)

    async def _load(self, load: Load) -> None:
        instance, version = load.instance, load.version
        timeout_s = self._config.weight_load_timeout_s
        async with self._load_locks[instance]:
            if self._in_flight:
                # an evaluation on the instance is of one version: the load waits for it (not
                # bounded by the load's timeout: an evaluation may take longer)
                await self._router.wait_unpinned(instance)
            if not self._orchestrator.is_pending(load):
                return  # the orchestrator gave the instance another load since (or lost it)
            try:
                async with asyncio.timeout(timeout_s):
                    # an adapter loads beside running calls; in-flight loads go under them
                    if not self._multi_version and not self._in_flight:
                        await self._router.wait_idle(instance)
            except TimeoutError:
                raise ServerTimeout(
                    f"instance {instance} still had calls in flight {timeout_s:g} s after it was "
                    f"emptied for version {version}"
                ) from None
            if not self._orchestrator.is_pending(load):
                return  # superseded while we waited (the store may have dropped `version` since)
            started = time.monotonic()
            incarnation = self._queue.incarnation
            under_calls = self._router.calls_in_flight(instance) if self._in_flight else 0
            if not await self._send_weights(instance, version):
                return
            seconds = time.monotonic() - started
            if incarnation != self._queue.incarnation and not self._orchestrator.is_pending(load):
                # A roll-back superseded the load: `version` may now name other weights. (A
                # load it kept is of a real version, whose weights the roll-back kept too.)
                self._versions.spoiled(instance, version)
                return
            self._versions.loaded(instance, version)
            self._stats.weight_loads += 1
            self._stats.weight_load_s += seconds
            self._metrics.write(
                WeightLoad(
                    instance=instance, version=version, seconds=seconds, under_calls=under_calls
                )
            )
        self._loaded(load)

    async def _send_weights(self, instance: str, version: int) -> bool:
        """Load `version` from the store onto `instance`, with `serve.weight_load_retries`
        retries after a timeout; False (and the instance counts as dead) if it did not."""
        if self.fast_load is not None and await self.fast_load(instance, version):
            return True
        timeout_s = self._config.weight_load_timeout_s
        weights = self._store.get(version)
        client = self._router.client(instance)
        tensors = None
        if not weights.path:
            tensors = {
                n: (d, s, b)
                for n, d, s, b in zip(
                    weights.names, weights.dtypes, weights.shapes, weights.data, strict=True
                )
            }
        retries = self._config.weight_load_retries
        for attempt in range(retries + 1):
            try:
                await client.load_weights(
                    version,
                    path=weights.path or None,
                    tensors=tensors,
                    mode="keep" if self._in_flight else "drain",
                    timeout_s=timeout_s,
                )
                return True
            except ServerUnavailable:
                self.failed(instance)
                return False
            except ServerTimeout as exc:
                what = f"the path {weights.path}" if weights.path else "inline tensors"
                error = (
                    f"instance {instance} did not load version {version} from {what} within "
                    f"{timeout_s:g} s (attempt {attempt + 1} of {retries + 1}): {exc}"
                )
                log.warning("%s", error)
                self._metrics.write(
                    WeightLoadTimeout(
                        instance=instance, version=version, attempt=attempt + 1, error=error
                    )
                )
                if attempt == retries:  # stuck: replace it (bounded by its own limit)
                    self.failed(instance)
                    return False
                self._stats.weight_load_retries += 1
        return False
