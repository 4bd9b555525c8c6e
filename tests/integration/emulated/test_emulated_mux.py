"""Generate calls over one multiplexed connection per instance (`GET /v1/mux`): answers matched by
id, the same as over HTTP; a dropped connection fails its calls in flight as `ServerUnavailable`
and the next call connects again; a call its caller gives up is stopped on the instance."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from dora.costs import apply_overrides, preset
from dora.emulated.instance import EmulatedInstance, ScaledClock
from dora.emulated.model import EmulatedModel
from dora.emulated.server import EmulatedServer
from dora.errors import ServerTimeout, ServerUnavailable
from dora.instance import EngineClient
from dora.protocol import SamplingParams
from dora.serve.emulated_cluster import EMULATED

pytestmark = pytest.mark.timeout(60)

SETUP = apply_overrides(preset("paper-64"), ["response_median=300", "response_max=2000"])
PROMPT = list(range(10, 60))
PARAMS = SamplingParams(max_tokens=5000)


@contextlib.asynccontextmanager
async def serving(
    scale: float, port: int = 0
) -> AsyncIterator[tuple[EmulatedServer, web.AppRunner, int]]:
    clock = ScaledClock(scale, asyncio.get_running_loop())
    model = EmulatedModel(SETUP, seed=0, vocab_size=100, first_token=7)
    server = EmulatedServer(
        EmulatedInstance(name="i0", setup=SETUP, clock=clock, model=model, version=0)
    )
    runner = web.AppRunner(server.app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield server, runner, runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def test_calls_share_one_multiplexed_connection_and_answer_as_over_http() -> None:
    async with serving(1e-4) as (_, _runner, port):
        url = f"http://127.0.0.1:{port}"
        async with (
            EngineClient(url, capabilities=EMULATED) as mux,
            EngineClient(url, capabilities=EMULATED, multiplex=False) as http,
        ):
            ids = [f"g/{i}#1" for i in range(16)]
            over_mux = await asyncio.gather(
                *(mux.generate(PROMPT, PARAMS, request_id=r, version=0) for r in ids)
            )
            over_http = await asyncio.gather(
                *(http.generate(PROMPT, PARAMS, request_id=r, version=0) for r in ids)
            )
            assert mux.mux.connects == 1 and http.mux.connects == 0
    for a, b in zip(over_mux, over_http, strict=True):
        assert a.request_id == b.request_id
        assert list(a.token_ids) == list(b.token_ids) and list(a.logprobs) == list(b.logprobs)
    assert len({tuple(c.token_ids) for c in over_mux}) > 1  # each answer went to its own call


async def test_a_dropped_connection_fails_calls_in_flight_as_unavailable_and_reconnects() -> None:
    async with serving(0.1) as (server, runner, port):  # hundreds of tokens: seconds
        client = EngineClient(f"http://127.0.0.1:{port}", capabilities=EMULATED)
        call = asyncio.ensure_future(client.generate(PROMPT, PARAMS, request_id="d/0#1"))
        await asyncio.sleep(0.3)  # the call is running: it takes seconds
        assert server.instance.find("d/0#1") is not None
        await runner.cleanup()  # the instance goes away with the call in flight
        with pytest.raises(ServerUnavailable):
            await call
    async with serving(1e-4, port) as _:  # back on the same address
        out = await client.generate(PROMPT, PARAMS, request_id="d/0#2")
        assert out.finish_reason in ("stop", "length") and client.mux.connects == 2
        await client.close()


async def test_a_call_its_caller_gives_up_is_stopped_on_the_instance() -> None:
    async with (
        serving(0.1) as (server, _runner, port),
        EngineClient(f"http://127.0.0.1:{port}", capabilities=EMULATED) as client,
    ):
        with pytest.raises(ServerTimeout):
            await client.generate(PROMPT, PARAMS, request_id="c/0#1", timeout_s=0.3)
        # the connection stays usable, and the cancel went out before this call
        out = await client.generate([1, 2, 3], SamplingParams(max_tokens=2), request_id="c/1#1")
        assert len(out.token_ids) <= 2 and client.mux.connects == 1
        assert server.instance.find("c/0#1") is None


async def test_an_address_that_refuses_the_upgrade_gets_its_calls_over_http() -> None:
    """A proxy in front of the instance that passes HTTP but not WebSockets (it answers the
    upgrade 404): the first call falls back to HTTP and succeeds, and so do the next, with no
    instance declared unreachable."""
    import aiohttp

    async with serving(1e-4) as (_, _runner, port):
        upstream = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:

            async def forward(request: web.Request) -> web.StreamResponse:
                if request.path == "/v1/mux":
                    return web.Response(status=404, text="not here")
                headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
                async with session.request(
                    request.method, upstream + request.path_qs, data=await request.read(),
                    headers=headers,
                ) as up:  # fmt: skip
                    return web.Response(status=up.status, body=await up.read(),
                                        content_type=up.content_type)  # fmt: skip

            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", forward)
            proxy = web.AppRunner(app, access_log=None)
            await proxy.setup()
            try:
                await web.TCPSite(proxy, "127.0.0.1", 0).start()
                url = f"http://127.0.0.1:{proxy.addresses[0][1]}"
                async with EngineClient(url, capabilities=EMULATED) as client:
                    assert client.multiplex
                    first = await client.generate(PROMPT, PARAMS, request_id="g/0#1", version=0)
                    assert not client.multiplex, "the refused upgrade switched it to HTTP"
                    second = await client.generate(PROMPT, PARAMS, request_id="g/1#1", version=0)
                assert first.token_ids and second.token_ids
            finally:
                await proxy.cleanup()
