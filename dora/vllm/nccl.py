"""vLLM's NCCL weight transfer, driven from dora serve's side: the order of calls on vLLM's routes
around the broadcast that trainer rank 0 makes.

The servers are started with `--weight-transfer-config '{"backend": "nccl"}'`. One NCCL group
holds trainer rank 0 (rank 0) and every worker of every instance: instance `i` with tensor
parallelism `tp` takes ranks `1 + i * tp .. (i + 1) * tp`, and `world_size = 1 + n * tp`.

- `init_group`: once, every server gets `POST /init_weight_transfer_engine` while the trainer
  opens the group (`open_trainer`, its side of the same rendezvous), all at once.
- `publish`: each version, for the instances that switch now. Each is drained and paused as any
  load is (`VllmClient.load_with`, which also resets the prefix cache, labels the version and
  resumes: a request never runs on weights other than its version), then gets
  `POST /start_weight_update`; once every one of them has, each gets `POST /update_weights` (names,
  dtypes, shapes, in the order of the broadcast) while the trainer broadcasts (`broadcast`), then
  `POST /finish_weight_update` with the version. An instance that loads an older version later
  does it from the weight store, as on a CPU.

The trainer's side (`open_trainer`, `broadcast`) is passed in: it runs in trainer rank 0, which
owns the tensors on its GPU. This module is tested against a recording double of the routes; it
has not run against vLLM on GPUs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from dora.vllm.client import VllmClient

__all__ = ["TransferGroup", "UpdateInfo", "init_group", "publish"]

Json = dict[str, object]


@dataclass(frozen=True, kw_only=True)
class TransferGroup:
    """The NCCL group of trainer rank 0 and `instances` servers of `tensor_parallel` workers."""

    master_address: str
    master_port: int
    instances: int
    tensor_parallel: int = 1

    @property
    def world_size(self) -> int:
        return 1 + self.instances * self.tensor_parallel

    def init_info(self, index: int) -> Json:
        """The body of instance `index`'s `/init_weight_transfer_engine`."""
        return {
            "init_info": {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "rank_offset": 1 + index * self.tensor_parallel,
                "world_size": self.world_size,
                "packed": True,
            }
        }


@dataclass(frozen=True, kw_only=True)
class UpdateInfo:
    """What the broadcast carries, in its order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def body(self) -> Json:
        return {
            "update_info": {
                "names": self.names,
                "dtype_names": self.dtype_names,
                "shapes": self.shapes,
            }
        }


async def init_group(
    clients: Sequence[VllmClient],
    group: TransferGroup,
    open_trainer: Callable[[], Awaitable[None]],
) -> None:
    """Open the group: every server and the trainer join one rendezvous concurrently."""
    if len(clients) != group.instances:
        raise ValueError(f"{len(clients)} clients for a group of {group.instances} instances")
    async with asyncio.TaskGroup() as tg:
        tg.create_task(_run(open_trainer))
        for i, client in enumerate(clients):
            tg.create_task(
                client.control("/init_weight_transfer_engine", group.init_info(i), "nccl init")
            )


async def publish(
    clients: Sequence[VllmClient],
    version: int,
    info: UpdateInfo,
    broadcast: Callable[[], Awaitable[None]],
    *,
    mode: str = "drain",
    timeout_s: float | None = None,
) -> None:
    """Load `version` into `clients` (the instances that switch now) by NCCL: see the module
    docstring for the order. The broadcast starts once every instance is paused and has started
    its update."""
    started = asyncio.Barrier(len(clients) + 1)

    def step(client: VllmClient) -> Callable[[], Awaitable[object]]:
        async def run() -> object:
            await client.control("/start_weight_update", {}, "nccl start")
            await started.wait()
            await client.control("/update_weights", info.body(), "nccl update")
            return await client.control(
                "/finish_weight_update", {"weight_version": str(version)}, "nccl finish"
            )

        return run

    async def trainer() -> None:
        await started.wait()
        await broadcast()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(trainer())
        for client in clients:
            tg.create_task(client.load_with(version, step(client), mode, timeout_s))


async def _run(side: Callable[[], Awaitable[None]]) -> None:
    await side()
