"""The NCCL weight transfer end to end on a CPU: serve's real parts (trainer link over a real ZMQ
link, weight store, orchestrator, instance lifecycle, vLLM clients) and the trainer's real sender
agree on the group and on the moment of each broadcast; a gloo group stands in for NCCL and
recording doubles of vLLM's routes receive over it. A broadcast the trainer never makes falls
back to the weight store: counted, logged, and every instance still ends on its version. In dora
mode only the instances that switch at publication are broadcast to; one that the orchestrator
moves later loads from the weight store."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from dora.config import DoraConfig, LearnConfig, RolloutConfig, ServeConfig
from dora.core.orchestrator import Mode, Orchestrator
from dora.core.transfer_queue import Admitted
from dora.errors import ServerTimeout
from dora.instance.interface import InstanceHandle
from dora.learn.nccl import NcclSender
from dora.learn.publish import inline_chunks
from dora.link import LearnLink, ServeLink
from dora.protocol import (
    Group,
    Hello,
    NcclBroadcast,
    NcclOpen,
    Sample,
    ServeMessage,
    StepDone,
    WeightsReady,
)
from dora.serve.journal import JournaledQueue
from dora.serve.lifecycle import InstanceLifecycle
from dora.serve.metrics import MetricsLog
from dora.serve.nccl import wire_nccl
from dora.serve.placement import Placement
from dora.serve.router import Router
from dora.serve.spawn import Spawner
from dora.serve.stats import ServeStats
from dora.serve.trainer_link import TrainerLink
from dora.serve.versions import InstanceVersions
from dora.serve.weights import WeightStore
from dora.vllm.client import VllmClient
from tests.unit.serve.nccl_parts import GlooVllm, gloo_servers, gloo_trainer

pytestmark = pytest.mark.timeout(120)

STEPS = 3


def _version(v: int) -> dict[str, torch.Tensor]:
    """Version `v` as the trainer publishes it: mixed dtypes, names not in sorted order."""
    gen = torch.Generator().manual_seed(v)
    return {
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=gen),
        "lm_head.weight": torch.randn(9, 4, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.randn(4, generator=gen),
    }


@dataclass
class Serve:
    """Serve's parts, wired as `Rollout` wires them for `learn.weight_transport = "nccl"`."""

    queue: JournaledQueue
    router: Router
    placement: Placement
    versions: InstanceVersions
    lifecycle: InstanceLifecycle
    trainer: TrainerLink
    stats: ServeStats
    metrics: MetricsLog

    def fill_step(self, step: int, version: int) -> None:
        """One group of `version` completes and fills `step` (batch size 1)."""
        gid = f"g{step}"
        assert isinstance(self.queue.try_admit(gid), Admitted)
        self.queue.start(gid)
        sample = Sample.build(
            token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0, 0], versions=[-1, version],
            prompt_len=1, reward=1.0,
        )  # fmt: skip
        self.trainer.groups[gid] = Group(id=gid, prompt_id=gid, version=version, samples=[sample])
        assert self.queue.complete(gid)


def _serve(config: DoraConfig, run_dir: Path, link: ServeLink, spawn: Spawner) -> Serve:
    metrics = MetricsLog(run_dir)
    stats = ServeStats()
    router = Router(kv_migration=False, stats=stats)
    orchestrator = Orchestrator(mode=Mode(config.rollout.mode))
    placement = Placement(orchestrator, router, metrics=metrics, spawn=spawn)
    versions = InstanceVersions(multi_version=False)
    queue = JournaledQueue(run_dir, groups_per_step=1, max_staleness=1, num_steps=STEPS)
    store = WeightStore()
    store.add_path(0, str(run_dir))
    lifecycle = InstanceLifecycle(
        config.serve, placement=placement, orchestrator=orchestrator, router=router,
        versions=versions, queue=queue, store=store, metrics=metrics, stats=stats, spawn=spawn,
    )  # fmt: skip
    placement.on_load = lifecycle.load
    placement.on_unload = lifecycle.unload
    router.on_failure = lifecycle.failed
    trainer = TrainerLink(
        config.rollout, config.learn, request_timeout_s=config.serve.request_timeout_s,
        env_name=config.env.cls, link=link, queue=queue, placement=placement,
        orchestrator=orchestrator, store=store, metrics=metrics, stats=stats, spawn=spawn,
        restored=queue.restore(),
    )  # fmt: skip
    wire_nccl(
        config.serve, mode=Mode(config.rollout.mode), orchestrator=orchestrator,
        lifecycle=lifecycle, trainer=trainer, router=router, store=store, stats=stats,
        metrics=metrics,
    )  # fmt: skip
    return Serve(queue, router, placement, versions, lifecycle, trainer, stats, metrics)


@dataclass
class Trainer:
    """Trainer rank 0 in a thread: publishes each version inline (serve's weight store) and keeps
    it for the broadcast, then answers serve's NCCL messages as `Trainer._train_step` does."""

    address: str
    answer_broadcasts: bool = True
    publish: list[int] = field(default_factory=list)
    seen: list[ServeMessage] = field(default_factory=list)
    error: BaseException | None = None

    def run(self, go: threading.Semaphore, stop: threading.Event) -> None:
        link = LearnLink(self.address)
        try:
            sender = NcclSender(
                send=link.send, address="127.0.0.1", device="cpu", timeout_s=30, open=gloo_trainer
            )
            link.send(Hello(role="learn", incarnation=0, step=0))
            pending = list(self.publish)
            while not stop.is_set():
                if pending and go.acquire(blocking=False):  # serve filled the step
                    self._publish(link, sender, pending.pop(0))
                try:
                    message = link.recv(timeout_s=0.1, waiting_for="serve")
                except ServerTimeout:
                    continue
                self.seen.append(message)
                if isinstance(message, NcclOpen) or (
                    isinstance(message, NcclBroadcast) and self.answer_broadcasts
                ):
                    sender.handle(message)
        except BaseException as exc:  # reported by the test, never lost
            self.error = exc
        finally:
            link.close()

    @staticmethod
    def _publish(link: LearnLink, sender: NcclSender, version: int) -> None:
        tensors = _version(version)
        chunks = inline_chunks(tensors, version=version)
        for chunk in chunks:
            link.send(chunk)
        link.send(WeightsReady(version=version, incarnation=0, num_chunks=len(chunks)))
        sender.keep(version, tensors)
        link.send(StepDone(step=version - 1, incarnation=0))


@contextlib.asynccontextmanager
async def running(
    config: DoraConfig, run_dir: Path, trainer: Trainer, instances: int
) -> AsyncIterator[tuple[Serve, list[tuple[GlooVllm, VllmClient]], Callable[[], None]]]:
    """Serve's parts with `instances` doubles, and the trainer thread, all stopped at the end."""
    log: list[tuple[str, str, object]] = []
    link = ServeLink()
    trainer.address = link.address
    spawn = Spawner()
    go, stop = threading.Semaphore(0), threading.Event()
    thread = threading.Thread(target=trainer.run, args=(go, stop), daemon=True)
    try:
        async with gloo_servers(instances, log) as servers, asyncio.TaskGroup() as tg:
            spawn.open(tg)
            serve = _serve(config, run_dir, link, spawn)
            for double, client in servers:
                handle = InstanceHandle(
                    id=double.name, url=client.base_url, client=client, stop=_noop
                )
                serve.lifecycle.add(handle)
            serve.queue.on_version_loaded(0)
            receiver = tg.create_task(serve.trainer.receive())
            thread.start()
            try:
                yield serve, servers, go.release
            finally:
                stop.set()
                await asyncio.to_thread(thread.join, 60)
                receiver.cancel()
                spawn.open(None)
                serve.metrics.close()
    finally:
        link.close()
    assert not thread.is_alive()
    assert trainer.error is None, trainer.error


async def _noop() -> None:
    return None


async def _until(serve: Serve, predicate: Callable[[], bool], timeout_s: float = 60) -> None:
    """Wait until `predicate()` holds, checking it after each load of the newest version."""
    loaded = asyncio.Event()
    serve.lifecycle.on_newest_loaded = lambda version: loaded.set()
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await loaded.wait()
            loaded.clear()


def _config(timeout_s: float, mode: str = "one_step_off") -> DoraConfig:
    return DoraConfig(
        rollout=RolloutConfig(mode=mode, batch_size=1, group_size=1, staleness=1),
        learn=LearnConfig(steps=STEPS, weight_transport="nccl"),
        serve=ServeConfig(backend="vllm", weight_load_timeout_s=timeout_s, weight_load_retries=0),
    )


def _assert_weights(servers: list[tuple[GlooVllm, VllmClient]], version: int) -> None:
    """Every double holds `version`'s tensors and its client says so."""
    for double, client in servers:
        assert client.version == version
        for name, tensor in _version(version).items():
            assert torch.equal(double.weights[name], tensor), name


def _holds(serve: Serve, servers: list[tuple[GlooVllm, VllmClient]], version: int) -> bool:
    return all(serve.versions.newest(d.name) == version for d, _ in servers)


async def test_nccl_versions_reach_every_instance_by_broadcast_through_serve_and_the_trainer(
    tmp_path: Path,
) -> None:
    trainer = Trainer(address="", publish=[1, 2])
    async with running(_config(timeout_s=30), tmp_path, trainer, instances=2) as (
        serve,
        servers,
        go,
    ):
        for version in (1, 2):
            serve.fill_step(version - 1, version - 1)
            go()
            await _until(serve, lambda v=version: _holds(serve, servers, v))
            for double, client in servers:
                assert client.version == version
                assert list(double.weights) == sorted(_version(version))
                for name, tensor in _version(version).items():
                    assert double.weights[name].dtype == tensor.dtype
                    assert torch.equal(double.weights[name], tensor), name
    assert serve.stats.nccl_loads == 4 and serve.stats.nccl_fallbacks == 0
    log = [(who, path) for who, path, _ in servers_log(servers)]
    for double, _ in servers:
        mine = [path for who, path in log if who == double.name]
        # one group for the run: opened once, then one broadcast per version
        assert mine.count("/init_weight_transfer_engine") == 1
        assert "/collective_rpc" not in mine  # nothing came from the weight store
        per_version = [
            "/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
            "/reset_prefix_cache", "/update_weight_version", "/resume",
        ]  # fmt: skip
        assert mine == ["/init_weight_transfer_engine", *per_version, *per_version]
    opens = [m for m in trainer.seen if isinstance(m, NcclOpen)]
    assert opens == [NcclOpen(generation=1, instances=2, tensor_parallel=1)]
    assert [m.version for m in trainer.seen if isinstance(m, NcclBroadcast)] == [1, 2]


def servers_log(servers: list[tuple[GlooVllm, VllmClient]]) -> list[tuple[str, str, object]]:
    return servers[0][0].log


async def test_nccl_broadcast_that_times_out_falls_back_to_the_weight_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = Trainer(address="", publish=[1], answer_broadcasts=False)
    caplog.set_level(logging.WARNING, logger="dora.serve")
    async with running(_config(timeout_s=3), tmp_path, trainer, instances=2) as (
        serve,
        servers,
        go,
    ):
        serve.fill_step(0, 0)
        go()
        await _until(serve, lambda: _holds(serve, servers, 1))
        _assert_weights(servers, 1)
    assert serve.stats.nccl_fallbacks == 2 and serve.stats.nccl_loads == 0
    rpc = [who for who, path, _ in servers_log(servers) if path == "/collective_rpc"]
    assert sorted(rpc) == ["i0", "i1"]
    records = [json.loads(line) for line in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    (fallback,) = [r for r in records if r.get("kind") == "nccl_fallback"]
    assert fallback["version"] == 1 and fallback["instances"] == ["i0", "i1"]
    assert "broadcast" in fallback["error"]
    assert any("weight store" in r.getMessage() for r in caplog.records)


async def test_in_dora_mode_the_instances_that_switch_at_publication_get_the_broadcast(
    tmp_path: Path,
) -> None:
    trainer = Trainer(address="", publish=[1])
    async with running(_config(timeout_s=30, mode="dora"), tmp_path, trainer, instances=2) as (
        serve,
        servers,
        go,
    ):
        busy = serve.placement.place(["old-request"], version=0)  # a long tail of version 0
        (free,) = [d.name for d, _ in servers if d.name != busy]
        serve.fill_step(0, 0)
        go()
        await _until(serve, lambda: serve.versions.newest(free) == 1)
        assert serve.versions.newest(busy) == 0  # still sampling version 0
        serve.placement.end("old-request")  # its tail ends: the orchestrator moves it to 1
        await _until(serve, lambda: _holds(serve, servers, 1))
        _assert_weights(servers, 1)
    assert serve.stats.nccl_loads == 1 and serve.stats.nccl_fallbacks == 0
    paths = {d.name: [p for who, p, _ in servers_log(servers) if who == d.name] for d, _ in servers}
    assert "/init_weight_transfer_engine" in paths[free] and "/collective_rpc" not in paths[free]
    assert "/init_weight_transfer_engine" not in paths[busy] and "/collective_rpc" in paths[busy]
    assert [m for m in trainer.seen if isinstance(m, NcclOpen)] == [
        NcclOpen(generation=1, instances=1, tensor_parallel=1)
    ]
