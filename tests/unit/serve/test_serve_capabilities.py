"""Serve asks an instance what it can do (`Capabilities`), never the backend's name or whether a
method happens to exist: each client declares its capabilities, and an instance that cannot drop
a version is never asked to."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from dora.config import ServeConfig
from dora.core.actions import Unload
from dora.core.orchestrator import Mode, Orchestrator
from dora.instance import Capabilities, EngineClient, common_capabilities
from dora.serve.emulated_cluster import EMULATED
from dora.serve.journal import JournaledQueue
from dora.serve.lifecycle import InstanceLifecycle
from dora.serve.metrics import MetricsLog
from dora.serve.placement import Placement
from dora.serve.router import Router
from dora.serve.spawn import Spawner
from dora.serve.stats import ServeStats
from dora.serve.versions import InstanceVersions
from dora.serve.weights import WeightStore
from dora.vllm.adapters import VllmAdapterClient
from dora.vllm.client import VllmClient


class Client:
    """An instance that records the versions it is asked to drop (it has `unload_weights`
    whatever it declares, as `EngineClient` does for every server of the engine's API)."""

    def __init__(self, capabilities: Capabilities) -> None:
        self.capabilities = capabilities
        self.unloaded: list[int] = []

    async def unload_weights(self, version: int, *, timeout_s: float | None = None) -> object:
        self.unloaded.append(version)
        return {"unloaded": version}


async def test_backends_declare_capabilities() -> None:
    engine = EngineClient("http://127.0.0.1:9")
    emulated = EngineClient("http://127.0.0.1:9", capabilities=EMULATED)
    vllm = VllmClient("http://127.0.0.1:9")
    adapters = VllmAdapterClient("http://127.0.0.1:9")
    try:
        assert engine.capabilities == Capabilities(
            kv_migration=True, lora_versions=True, sessions=True
        )
        assert emulated.capabilities == Capabilities(
            kv_migration=True, lora_versions=False, sessions=True
        )
        # vLLM keeps its HTTP API: every call sends the whole context
        assert vllm.capabilities == Capabilities(
            kv_migration=False, lora_versions=False, sessions=False
        )
        assert adapters.capabilities == Capabilities(
            kv_migration=False, lora_versions=True, sessions=False
        )
        # the pool can do what every instance can
        assert common_capabilities([engine, emulated]) == EMULATED
        assert common_capabilities([engine, adapters]) == Capabilities(
            kv_migration=False, lora_versions=True
        )
        with pytest.raises(AttributeError):
            engine.capabilities.kv_migration = False  # type: ignore[misc]  # frozen
    finally:
        for client in (engine, emulated, vllm, adapters):
            await client.close()


@pytest.mark.parametrize("lora_versions", [False, True], ids=["one-version", "adapters"])
async def test_unload_asks_only_an_instance_that_can_drop_versions(
    tmp_path: Path, lora_versions: bool
) -> None:
    metrics = MetricsLog(tmp_path)
    spawn = Spawner()
    orchestrator, router = Orchestrator(mode=Mode("dora")), Router(kv_migration=True)
    placement = Placement(orchestrator, router, metrics=metrics, spawn=spawn)
    queue = JournaledQueue(tmp_path, groups_per_step=1, max_staleness=1, num_steps=1)
    versions = InstanceVersions(multi_version=True)
    lifecycle = InstanceLifecycle(
        ServeConfig(),
        placement=placement,
        orchestrator=orchestrator,
        router=router,
        versions=versions,
        queue=queue,
        store=WeightStore(),
        metrics=metrics,
        stats=ServeStats(),
        spawn=spawn,
    )
    client = Client(Capabilities(kv_migration=True, lora_versions=lora_versions))
    router.add_instance("i0", client)  # type: ignore[arg-type]
    lifecycle._load_locks["i0"] = asyncio.Lock()
    versions.add("i0")
    versions.loaded("i0", 3)
    try:
        async with asyncio.TaskGroup() as tg:
            spawn.open(tg)
            lifecycle.unload(Unload(instance="i0", version=3))
        spawn.open(None)
        assert client.unloaded == ([3] if lora_versions else [])
        assert not versions.holds("i0", 3)
    finally:
        metrics.close()
