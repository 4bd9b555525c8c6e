"""A runner's side (`dora.serve.runner_episodes`) against a fake serve (a ROUTER socket speaking
serve's messages) and an instance that never answers: serve ends the call first (it declared the
instance dead), the runner stops waiting for the instance, asks for the next route with its
tokens so far, and when serve refuses it, the episode ends masked and its result goes back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from dora.config import DoraConfig, ServeConfig
from dora.episode import ChatRenderer, EpisodeLimits
from dora.models.tiny import char_tokenizer
from dora.protocol import SamplingParams
from dora.serve.runner_episodes import EpisodeRunner
from dora.serve.runner_wire import (
    CallDone,
    CoordinatorMessage,
    EpisodeDone,
    NeedRoute,
    Route,
    RunEpisode,
    RunnerHello,
    RunnerMessage,
    Welcome,
    decode_from_runner,
    encode,
)
from envs.math import ChainArithmeticEnv

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def silent_instance() -> AsyncIterator[str]:
    """An instance that takes generate calls over HTTP and never answers them."""

    released = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await released.wait()  # until the test ends
        return web.Response(status=503)

    app = web.Application()
    app.router.add_post("/v1/completions", hang)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        released.set()
        await runner.cleanup()


class FakeServe:
    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.peer = b""

    async def recv(self) -> RunnerMessage:
        async with asyncio.timeout(10):
            self.peer, frame = await self.sock.recv_multipart()
        return decode_from_runner(frame)

    async def recv_not_beat(self) -> RunnerMessage:
        while True:
            message = await self.recv()
            if type(message).__name__ != "Beat":
                return message

    async def send(self, message: CoordinatorMessage) -> None:
        await self.sock.send_multipart([self.peer, encode(message)])


async def test_runner_call_serve_ended_first_is_cut_and_the_episode_goes_on() -> None:
    ctx = zmq.asyncio.Context()
    serve = FakeServe(ctx)
    config = DoraConfig(serve=ServeConfig(token="t", request_timeout_s=20))
    renderer = ChatRenderer(char_tokenizer())  # type: ignore[arg-type]
    runner = EpisodeRunner(
        address=serve.address,
        name="r",
        token="t",
        config=config,
        env_factory=lambda: ChainArithmeticEnv(instruction=""),
        renderer=renderer,
        limits=EpisodeLimits(),
    )
    try:
        async with silent_instance() as url, asyncio.TaskGroup() as tg:
            running = tg.create_task(runner.run())
            hello = await serve.recv()
            assert isinstance(hello, RunnerHello) and hello.token == "t"
            welcomed_at = time.process_time()
            await serve.send(Welcome(heartbeat_s=1.0))
            data = {"question": "1+2", "answer": "3"}
            params = SamplingParams(max_tokens=8)
            order = RunEpisode(
                lease="g0/0", attempt=7, version=0, prompt_id="p", data=data, params=params
            )
            await serve.send(order)
            need = await serve.recv_not_beat()
            assert need == NeedRoute(lease="g0/0", attempt=7, seq=1)
            route = Route(
                lease="g0/0",
                attempt=7,
                seq=1,
                instance="i0",
                url=url,
                call_id="g0/0#1",
                version=0,
                session=None,
            )
            await serve.send(route)
            await asyncio.sleep(0.3)  # the call is now waiting on the silent instance
            await serve.send(CallDone(lease="g0/0", attempt=7, seq=1, interrupted=True))
            # the runner gave up on the instance and asks again, with no CallEnd in between
            again = await serve.recv_not_beat()
            assert again == NeedRoute(lease="g0/0", attempt=7, seq=2)
            await serve.send(CallDone(lease="g0/0", attempt=7, seq=2, refused="no instance"))
            done = await serve.recv_not_beat()
            assert isinstance(done, EpisodeDone) and (done.lease, done.attempt) == ("g0/0", 7)
            assert done.sample.masked
            # the CPU it reports is its work since the welcome, not its process's start-up (here
            # the test process's imports, which took seconds)
            assert 0 < done.cpu_s <= time.process_time() - welcomed_at < welcomed_at
            running.cancel()
    finally:
        runner.close()
        ctx.destroy(linger=0)
