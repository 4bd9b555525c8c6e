"""Which version an instance holds has one owner in serve, `InstanceVersions`: the instance
lifecycle records loads there, a trainer's roll-back forgets ghost versions there, and a `Load`
is carried out (or found done) by reading it, never a copy kept elsewhere."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dora.config import DoraConfig, LearnConfig, RolloutConfig, ServeConfig
from dora.core.transfer_queue import Admitted
from dora.instance import Capabilities
from dora.protocol import Hello
from dora.serve.journal import JournaledQueue
from dora.serve.lifecycle import InstanceLifecycle
from dora.serve.router import Router
from dora.serve.versions import InstanceVersions
from tests.unit.serve.link_parts import serve_parts


class LoadingClient:
    """An instance that records the versions it is asked to load."""

    capabilities = Capabilities(kv_migration=True, lora_versions=False)

    def __init__(self) -> None:
        self.loaded: list[int] = []

    async def load_weights(self, version: int, **_: object) -> dict[str, object]:
        self.loaded.append(version)
        return {}


class Handle:
    def __init__(self, client: LoadingClient) -> None:
        self.id = "i0"
        self.client = client
        self.set_background = None


def test_versions_single_and_multi() -> None:
    one, many = InstanceVersions(multi_version=False), InstanceVersions(multi_version=True)
    for v in (one, many):
        v.add("i0")
        assert v.holds("i0", 0) and v.newest("i0") == 0
        v.loaded("i0", 2)
        v.loaded("i0", 3)
    assert one.held("i0") == {3} and many.held("i0") == {0, 2, 3}
    many.dropped("i0", 2)
    assert many.held("i0") == {0, 3} and many.newest("i0") == 3
    one.spoiled("i0", 4)  # a load a roll-back superseded: the weights are unknown
    many.spoiled("i0", 3)  # on a multi-version instance only that adapter
    assert one.newest("i0") == -1 and not one.held("i0")
    assert many.held("i0") == {0}
    many.loaded("i0", 5)
    many.forget_newer(1)  # a roll-back: versions above 1 are ghosts
    assert many.held("i0") == {0} and many.newest("i0") == 0


async def test_rollback_and_lifecycle_read_one_record_of_versions(tmp_path: Path) -> None:
    """The lifecycle loads version 2; the trainer restarts from step 0's checkpoint, so version
    2 is a ghost: the roll-back forgets it in the one record, and the `Load` of the real version
    that follows goes to the instance instead of being taken as done."""
    config = DoraConfig(
        rollout=RolloutConfig(batch_size=1, group_size=1, staleness=3),
        learn=LearnConfig(steps=10),
    )
    q = JournaledQueue(tmp_path, groups_per_step=1, max_staleness=3, num_steps=10)
    router = Router(kv_migration=True)
    versions = InstanceVersions(multi_version=False)
    parts = serve_parts(config, q, router, tmp_path, versions=versions)
    placement, store, spawn, metrics = parts.placement, parts.store, parts.spawn, parts.metrics
    lifecycle = InstanceLifecycle(
        ServeConfig(),
        placement=placement,
        orchestrator=parts.orchestrator,
        router=router,
        versions=versions,
        queue=q,
        store=store,
        metrics=metrics,
        stats=parts.stats,
        spawn=spawn,
    )
    placement.on_load, placement.on_unload = lifecycle.load, lifecycle.unload
    router.on_failure = lifecycle.failed
    q.on_version_loaded(0)
    for step, gid in enumerate(("A", "B")):  # steps 0 and 1 filled and trained: version 2
        assert isinstance(q.try_admit(gid), Admitted)
        q.start(gid)
        q.complete(gid)
        q.on_step_done(step)
    client = LoadingClient()
    store.add_path(2, str(tmp_path))
    try:
        async with asyncio.TaskGroup() as tg:
            spawn.open(tg)
            lifecycle.add(Handle(client))  # type: ignore[arg-type]
            placement.apply(parts.orchestrator.publish(2))
            for _ in range(5):
                await asyncio.sleep(0)
            assert client.loaded == [2] and versions.newest("i0") == 2
            parts.rollback(Hello(role="learn", incarnation=1, step=1))
            assert versions.newest("i0") == -1 and not versions.holds("i0", 2)
            for _ in range(5):
                await asyncio.sleep(0)
        spawn.open(None)
        assert client.loaded == [2, 0], "the ghost was forgotten: version 0 is loaded again"
        assert versions.newest("i0") == 0
    finally:
        metrics.close()
        q.close()
