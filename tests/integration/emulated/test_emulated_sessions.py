"""Sessions over an emulated instance's real HTTP API: a continuing episode sends only what is new,
an instance that lost the session gets the whole context (counted), an edited history replaces
the session (counted), and a released session is dropped with the next call."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest
from aiohttp import web

from dora.costs import apply_overrides, preset
from dora.emulated.instance import EmulatedInstance, ScaledClock
from dora.emulated.model import EmulatedModel
from dora.emulated.server import EmulatedServer
from dora.errors import RequestError
from dora.instance import EngineClient
from dora.instance.session import SESSION_COUNTS
from dora.protocol import SamplingParams
from dora.serve.emulated_cluster import EMULATED

pytestmark = pytest.mark.timeout(60)

SETUP = apply_overrides(preset("paper-64"), ["response_median=30", "response_max=200"])
PROMPT = list(range(10, 60))
PARAMS = SamplingParams(max_tokens=100)
TOOL = [5] * 20


@contextlib.asynccontextmanager
async def instance() -> AsyncIterator[tuple[EmulatedServer, EngineClient, list[dict[str, object]]]]:
    """One emulated instance, a client that keeps sessions, and the bodies of its generates."""
    clock = ScaledClock(1e-4, asyncio.get_running_loop())
    model = EmulatedModel(SETUP, seed=0, vocab_size=100, first_token=7)
    server = EmulatedServer(
        EmulatedInstance(name="i0", setup=SETUP, clock=clock, model=model, version=0)
    )
    bodies: list[dict[str, object]] = []
    complete = server._complete  # what both transports (HTTP, the multiplexed one) call

    async def record(body: bytes) -> object:
        bodies.append(msgspec.json.decode(body))
        return await complete(body)

    server._complete = record  # type: ignore[method-assign,assignment]
    runner = web.AppRunner(server.app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        async with EngineClient(f"http://{host}:{port}", capabilities=EMULATED) as client:
            yield server, client, bodies
    finally:
        await runner.cleanup()


def counts() -> tuple[int, int, int, int]:
    c = SESSION_COUNTS
    return c.delta, c.full, c.unknown, c.replaced


async def test_session_call_sends_only_what_is_new() -> None:
    async with instance() as (server, client, bodies):
        before = counts()
        first = await client.generate(PROMPT, PARAMS, request_id="e/0#1", version=0, session="e/0")
        context = [*PROMPT, *first.token_ids, *TOOL]
        second = await client.generate(
            context, PARAMS, request_id="e/0#2", version=0, session="e/0"
        )
        # the same call without a session, on the same instance: the same answer
        plain = await client.generate(context, PARAMS, request_id="e/0#2", version=0)
    assert bodies[0]["prompt"] == PROMPT and "session_extends" not in bodies[0]
    assert bodies[1]["prompt"] == TOOL
    assert bodies[1]["session_extends"] == len(PROMPT) + len(first.token_ids)
    assert bodies[2]["prompt"] == context and "session_id" not in bodies[2]
    assert list(second.token_ids) == list(plain.token_ids)
    assert second.prompt_tokens == len(context)
    assert counts() == (before[0] + 1, before[1] + 1, before[2], before[3])
    assert "e/0" in server.sessions


async def test_unknown_session_falls_back_to_the_whole_context_and_is_counted() -> None:
    async with instance() as (server, client, bodies):
        first = await client.generate(PROMPT, PARAMS, request_id="e/1#1", version=0, session="e/1")
        server.sessions.release(["e/1"])  # as after a restart of the instance
        before = counts()
        context = [*PROMPT, *first.token_ids, *TOOL]
        second = await client.generate(
            context, PARAMS, request_id="e/1#2", version=0, session="e/1"
        )
        third = [*context, *second.token_ids, *TOOL]
        await client.generate(third, PARAMS, request_id="e/1#3", version=0, session="e/1")
    assert [b["prompt"] for b in bodies[1:]] == [TOOL, context, TOOL]
    assert counts()[2] == before[2] + 1  # one fallback, then the session goes on


async def test_session_replaced_when_the_history_is_edited() -> None:
    async with instance() as (_, client, bodies):
        first = await client.generate(PROMPT, PARAMS, request_id="e/2#1", version=0, session="e/2")
        before = counts()
        edited = [*PROMPT[:5], 99, *PROMPT[6:], *first.token_ids, *TOOL]
        await client.generate(edited, PARAMS, request_id="e/2#2", version=0, session="e/2")
    assert bodies[1]["prompt"] == edited and "session_extends" not in bodies[1]
    assert counts()[3] == before[3] + 1


async def test_released_session_is_dropped_with_the_next_call() -> None:
    async with instance() as (server, client, bodies):
        await client.generate(PROMPT, PARAMS, request_id="e/3#1", version=0, session="e/3")
        client.release_session("e/3")
        await client.generate(PROMPT, PARAMS, request_id="e/4#1", version=0, session="e/4")
        assert "e/3" not in server.sessions and "e/4" in server.sessions
    assert bodies[1]["release_sessions"] == ["e/3"]


async def test_session_fields_that_do_not_fit_are_refused() -> None:
    async with instance() as (_, client, _bodies):
        for body, why in (
            ({"prompt": PROMPT, "session_extends": 3}, "session_extends needs a session_id"),
            ({"prompt": PROMPT, "session_id": "s", "stream": True}, "n = 1 and does not stream"),
            ({"prompt": [], "session_id": "s"}, "prompt is empty"),
        ):
            with pytest.raises(RequestError, match=f"HTTP 400: .*{why}"):
                await client.http.post_json("/v1/completions", body, 10.0, "generate")
