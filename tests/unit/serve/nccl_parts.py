"""Stand-ins for the NCCL weight transfer on a CPU: a gloo group in place of vLLM's NCCL
communicator, and a recording double of a vLLM server's routes whose weight-transfer routes do
what vLLM's do over that group (join it at `/init_weight_transfer_engine`, receive each tensor of
the `/update_weights` body in its order), so serve's and the trainer's real code meet over it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from aiohttp import web

from dora.vllm.client import VllmClient
from dora.weight_transfer import TransferGroup

GLOO_TIMEOUT_S = 20.0


class GlooCommunicator:
    """`broadcast(tensor, src)` over one rank of a gloo group."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        timeout = datetime.timedelta(seconds=GLOO_TIMEOUT_S)
        self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()


def gloo_trainer(group: TransferGroup) -> GlooCommunicator:
    """Trainer rank 0's side: listen at the group's address and port, as vLLM's
    `StatelessProcessGroup` does, and join as rank 0."""
    store = dist.TCPStore(
        group.master_address,
        group.master_port,
        group.world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
    )
    return GlooCommunicator(store, 0, group.world_size)


def receive(communicator: GlooCommunicator, body: dict[str, object]) -> dict[str, torch.Tensor]:
    """What vLLM's unpacked NCCL receive does with an `/update_weights` body."""
    info = body["update_info"]
    assert isinstance(info, dict) and info["packed"] is False
    got = {}
    for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype))
        communicator.broadcast(tensor, src=0)
        got[name] = tensor
    return got


@dataclass
class GlooVllm:
    """A vLLM server's control routes; the weight-transfer ones over a gloo group."""

    name: str
    log: list[tuple[str, str, object]]
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    communicator: GlooCommunicator | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 26)
        for route in ("/pause", "/resume", "/reset_prefix_cache", "/update_weight_version"):
            app.router.add_post(route, self.record)
        app.router.add_post("/start_weight_update", self.record)
        app.router.add_post("/finish_weight_update", self.record)
        app.router.add_post("/init_weight_transfer_engine", self.init)
        app.router.add_post("/update_weights", self.update)
        app.router.add_post("/collective_rpc", self.rpc)
        return app

    async def _body(self, request: web.Request) -> object:
        body = await request.json() if request.can_read_body else None
        self.log.append((self.name, request.path, body))
        return body

    async def record(self, request: web.Request) -> web.Response:
        await self._body(request)
        return web.json_response({"success": True})

    async def init(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        assert isinstance(body, dict)
        info = body["init_info"]
        store = await asyncio.to_thread(
            dist.TCPStore,
            info["master_address"],
            info["master_port"],
            info["world_size"],
            is_master=False,
            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
        )
        self.communicator = await asyncio.to_thread(
            GlooCommunicator, store, info["rank_offset"], info["world_size"]
        )
        return web.json_response({})

    async def update(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        assert isinstance(body, dict) and self.communicator is not None
        self.weights = await asyncio.to_thread(receive, self.communicator, body)
        return web.json_response({})

    async def rpc(self, request: web.Request) -> web.Response:
        """The worker extension's load from the weight store (`dora_load_tensors`)."""
        body = await self._body(request)
        assert isinstance(body, dict) and body["method"] == "dora_load_tensors"
        (tensors,) = body["args"]
        self.weights = {
            name: torch.frombuffer(bytearray(base64.b64decode(data)), dtype=getattr(torch, dtype))
            .reshape(shape)
            .clone()
            for name, dtype, shape, data in zip(
                tensors["names"], tensors["dtypes"], tensors["shapes"], tensors["data"], strict=True
            )
        }
        return web.json_response({"results": []})


@contextlib.asynccontextmanager
async def gloo_servers(
    n: int, log: list[tuple[str, str, object]]
) -> AsyncIterator[list[tuple[GlooVllm, VllmClient]]]:
    """`n` doubles on 127.0.0.1:0 with their clients; all stopped at the end."""
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for i in range(n):
            double = GlooVllm(f"i{i}", log)
            runner = web.AppRunner(double.app())
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            client = VllmClient(f"http://127.0.0.1:{port}", control_timeout_s=30)
            stack.push_async_callback(client.close)
            out.append((double, client))
        yield out
