"""vLLM's NCCL weight transfer, driven from dora serve's side: the order of calls on vLLM's routes
around the broadcast that trainer rank 0 makes.

The servers are started with `--weight-transfer-config '{"backend": "nccl"}'`. One NCCL group
holds trainer rank 0 (rank 0) and every worker of every instance (`dora.weight_transfer`: the
ranks, and the order of the tensors in a broadcast, which both sides derive on their own).

- `init_group`: once, every server gets `POST /init_weight_transfer_engine` while the trainer
  opens the group (`open_trainer`, its side of the same rendezvous), all at once.
- `publish`: each version, for the instances that switch now. Each is drained and paused as any
  load is (`VllmClient.load_with`, which also resets the prefix cache, labels the version and
  resumes: a request never runs on weights other than its version), then gets
  `POST /start_weight_update`; once every one of them has, each gets `POST /update_weights` (names,
  dtypes, shapes, in the order of the broadcast: `UpdateInfo.of` the version as the weight store
  holds it) while the trainer broadcasts (`broadcast`, `dora.learn.nccl.broadcast_weights`), then
  `POST /finish_weight_update` with the version. An instance that loads an older version later
  does it from the weight store, as on a CPU.

The trainer's side (`open_trainer`, `broadcast`) is passed in: it runs in trainer rank 0, which
owns the tensors on its GPU (`dora.learn.nccl`). This module is tested against a recording double
of the routes; it has not run against vLLM on GPUs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from dora.vllm.client import VllmClient
from dora.weight_transfer import TransferGroup, UpdateInfo

__all__ = ["TransferGroup", "UpdateInfo", "init_group", "publish"]


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
