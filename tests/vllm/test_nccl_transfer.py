"""vLLM's NCCL weight transfer, driven by `dora.vllm.nccl`, against recording doubles of vLLM's
routes (aiohttp on 127.0.0.1:0): the order of calls on every instance, the broadcast placed after
every instance started its update and before any finished, the group's ranks, and the version
bookkeeping that every load keeps."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from dora.vllm.client import VllmClient
from dora.vllm.nccl import TransferGroup, UpdateInfo, init_group, publish

pytestmark = pytest.mark.timeout(30)

ROUTES = (
    "/pause",
    "/resume",
    "/reset_prefix_cache",
    "/update_weight_version",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)


@dataclass
class RecordingVllm:
    """Records `(name, path, body)` of every control call into a log shared by all doubles."""

    name: str
    log: list[tuple[str, str, object]]
    bodies: dict[str, object] = field(default_factory=dict)

    def app(self) -> web.Application:
        app = web.Application()
        for route in ROUTES:
            app.router.add_post(route, self.record)
        return app

    async def record(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.log.append((self.name, request.path, body))
        self.bodies[request.path] = body
        await asyncio.sleep(0.01)  # let the others interleave
        return web.json_response({"success": True})


@contextlib.asynccontextmanager
async def doubles(n: int, log: list[tuple[str, str, object]]) -> AsyncIterator[list[VllmClient]]:
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for i in range(n):
            runner = web.AppRunner(RecordingVllm(f"i{i}", log).app())
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            client = VllmClient(f"http://127.0.0.1:{port}", control_timeout_s=5)
            stack.push_async_callback(client.close)
            clients.append(client)
        yield clients


async def test_the_group_gives_each_worker_its_rank_and_opens_with_the_trainer() -> None:
    log: list[tuple[str, str, object]] = []
    group = TransferGroup(
        master_address="10.0.0.9", master_port=29500, instances=3, tensor_parallel=2
    )

    async def open_trainer() -> None:
        log.append(("trainer", "open", None))

    async with doubles(3, log) as clients:
        await init_group(clients, group, open_trainer)
    inits = {name: body for name, path, body in log if path == "/init_weight_transfer_engine"}
    assert [inits[f"i{i}"]["init_info"]["rank_offset"] for i in range(3)] == [1, 3, 5]  # type: ignore[index]
    assert {b["init_info"]["world_size"] for b in inits.values()} == {7}  # type: ignore[index]
    # vLLM builds its NCCL init info from these fields and refuses any other
    assert {tuple(sorted(b["init_info"])) for b in inits.values()} == {  # type: ignore[index]
        ("master_address", "master_port", "rank_offset", "world_size")
    }
    assert ("trainer", "open", None) in log


async def test_a_publish_calls_the_routes_in_order_around_one_broadcast() -> None:
    log: list[tuple[str, str, object]] = []
    info = UpdateInfo(names=["w", "b"], dtype_names=["bfloat16", "bfloat16"], shapes=[[4, 4], [4]])

    async def broadcast() -> None:
        log.append(("trainer", "broadcast", None))

    async with doubles(2, log) as clients:
        await publish(clients, 3, info, broadcast)
        assert [c.version for c in clients] == [3, 3]
    for name in ("i0", "i1"):
        mine = [path for who, path, _ in log if who == name]
        assert mine == [
            "/pause",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/reset_prefix_cache",
            "/update_weight_version",
            "/resume",
        ]
    order = [(who, path) for who, path, _ in log]
    at = order.index(("trainer", "broadcast"))
    starts = [i for i, (_, path) in enumerate(order) if path == "/start_weight_update"]
    finishes = [i for i, (_, path) in enumerate(order) if path == "/finish_weight_update"]
    assert max(starts) < at < min(finishes)
    bodies = {(who, path): body for who, path, body in log}
    assert bodies[("i0", "/update_weights")] == {
        "update_info": {
            "names": ["w", "b"],
            "dtype_names": ["bfloat16", "bfloat16"],
            "shapes": [[4, 4], [4]],
            "packed": False,
        }
    }
    assert bodies[("i1", "/finish_weight_update")] == {"weight_version": "3"}
    assert bodies[("i1", "/update_weight_version")] == {"new_version": "3"}


async def test_a_failed_broadcast_leaves_the_instances_paused_and_unusable() -> None:
    log: list[tuple[str, str, object]] = []
    info = UpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[1]])

    async def broadcast() -> None:
        raise RuntimeError("NCCL timeout")

    async with doubles(1, log) as clients:
        with pytest.raises(ExceptionGroup):
            await publish(clients, 1, info, broadcast)
        assert clients[0].version == -1  # no request runs on half-updated weights
    assert "/resume" not in [path for _, path, _ in log]
