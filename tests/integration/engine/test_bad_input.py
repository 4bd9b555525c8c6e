"""The engine's HTTP server against bad and hostile input: each is a 4xx naming the problem, the
server keeps serving, and control stays closed to callers without the token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import pytest

from dora.engine import EngineClient, EngineServer
from dora.errors import ConfigError, ServerUnavailable
from dora.instance import api
from dora.protocol import SamplingParams

pytestmark = pytest.mark.timeout(60)

Json = dict[str, object]


async def send(
    url: str, data: bytes | AsyncIterator[bytes], headers: dict[str, str] | None = None
) -> tuple[int, str]:
    """POST raw bytes; (status, error message or body text)."""
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        text = await r.text()
    try:
        return r.status, str(msgspec.json.decode(text)["error"]["message"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return r.status, text


def json_body(body: Json) -> bytes:
    return msgspec.json.encode(body)


async def test_off_loopback_bind_needs_a_control_token(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match=r"'0\.0\.0\.0', off loopback.*serve\.token"):
        async with EngineServer.start(tiny_model, host="0.0.0.0"):
            pass


async def test_every_control_route_is_401_without_the_token(tiny_model: Path) -> None:
    async with EngineServer.start(tiny_model, control_token="s3cret") as srv:
        routes = ["load_weights", "pause", "resume", "abort", "export", "import"]
        for route in routes:
            for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                status, message = await send(f"{srv.url}/control/{route}", b"{}", headers)
                assert status == 401, (route, headers, status)
                assert "bearer token" in message
        assert srv.worker.paused is False  # nothing a refused caller asked for happened
        status, _ = await send(
            f"{srv.url}/control/pause", b"{}", {"Authorization": "Bearer s3cret"}
        )
        assert status == 200 and srv.worker.paused is True
        async with EngineClient(srv.url) as anonymous:  # the OpenAI routes need no token
            with pytest.raises(ServerUnavailable, match="paused"):  # a paused engine is not ready
                await anonymous.health()


async def test_oversized_bodies_are_413_also_when_chunked(tiny_model: Path) -> None:
    async with EngineServer.start(
        tiny_model, max_request_bytes=1000, max_control_bytes=2000
    ) as srv:
        big = json_body({"prompt": "a" * 5000})
        status, message = await send(srv.url + "/v1/completions", big)
        assert status == 413 and f"{len(big)} bytes exceeds the limit of 1000" in message

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit still holds
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"a" * 100
            yield b'"}'

        status, message = await send(srv.url + "/v1/completions", chunks())
        assert status == 413 and "limit of 1000 bytes" in message
        status, _ = await send(srv.url + "/control/abort", json_body({"request_id": "x" * 3000}))
        assert status == 413
        status, _ = await send(srv.url + "/v1/completions", json_body({"prompt": "ab"}))
        assert status == 200  # the server serves on


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b'{"prompt": "\xff\xfe"}', "not valid UTF-8 JSON"),
        (b"\xef\xbb\xbf\x00\x01", "not valid UTF-8 JSON"),
        (b"prompt=hello", "not valid UTF-8 JSON"),
        (b"", "not valid UTF-8 JSON"),
        (b'["a"]', "must be a JSON object, got list"),
        (b'{"prompt": "a", "temperature": "hot"}', "$.temperature"),
        (b'{"prompt": "a", "n": 0}', "$.n"),
        (b'{"prompt": "a", "max_tokens": -3}', "$.max_tokens"),
        (b'{"prompt": {"text": "a"}}', "$.prompt"),
        (b'{"temperature": 1}', "prompt"),
        (b'{"prompt": "a", "max_token": 3}', "max_token (did you mean max_tokens?)"),
        (b'{"prompt": "a", "presence_penalty": 0.5}', "unsupported field(s) of the OpenAI API"),
        (b'{"prompt": ""}', "prompt is empty"),
        (b'{"prompt": [-1]}', "out of range"),
        (b"[" * 100_000, "nested too deeply"),
        (b'{"prompt": ' + b"[" * 100_000, "nested too deeply"),
        (b'{"prompt": [1, 2], "top_k": -5}', "$.top_k"),
        (b'{"prompt": [1, 2], "stop_token_ids": [-1]}', "$.stop_token_ids"),
        (b'{"prompt": [1, 2], "stop_token_ids": [100000000]}', "stop_token_ids out of range"),
        (b'{"prompt": [1, 2], "seed": -1}', "$.seed"),
        (b'{"prompt": [1, 2], "seed": 1208925819614629174706176}', "$.seed"),
        (b'{"prompt": [8, 79], "max_tokens": 4, "temperature": 1e-45}', "temperature = 1e-45"),
    ],
)
async def test_bad_completion_bodies_are_400_naming_the_problem(
    server: EngineServer, body: bytes, problem: str
) -> None:
    status, message = await send(server.url + "/v1/completions", body)
    assert status == 400, message
    assert problem in message


async def test_long_prompts_and_malformed_messages_are_400(server: EngineServer) -> None:
    context = server.worker.batcher.max_model_len
    long_text = "a" * (context + 10)
    status, message = await send(
        server.url + "/v1/chat/completions",
        json_body({"messages": [{"role": "user", "content": long_text}]}),
    )
    assert status == 400 and f"does not fit the context of {context} tokens" in message
    status, message = await send(
        server.url + "/v1/completions", json_body({"prompt": [5] * context, "max_tokens": 1})
    )
    assert status == 400 and f"prompt of {context} tokens" in message
    chat = server.url + "/v1/chat/completions"
    status, message = await send(chat, json_body({"messages": [{"content": "a"}]}))
    assert status == 400 and "messages[0].role = None" in message
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": 3}]
    status, message = await send(chat, json_body({"messages": bad}))
    assert status == 400 and "messages[1].content is int" in message
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/cat.png"}}
    parts = [{"type": "text", "text": "what is this?"}, image]
    status, message = await send(
        chat, json_body({"messages": [{"role": "user", "content": parts}], "max_tokens": 2})
    )
    assert status == 400 and "messages[0].content[1] is of type 'image_url'" in message
    status, message = await send(
        chat, json_body({"messages": [{"role": "user", "content": parts[:1]}], "max_tokens": 2})
    )
    assert status == 200, message  # text parts are fine


async def test_a_trickled_body_is_cut_at_its_deadline(tiny_model: Path) -> None:
    async with EngineServer.start(tiny_model, body_timeout_s=0.5) as srv:

        async def trickle() -> AsyncIterator[bytes]:
            yield b'{"prompt": "'
            for _ in range(50):
                await asyncio.sleep(0.2)
                yield b"a"

        status, message = await send(srv.url + "/v1/completions", trickle())
        assert status == 408 and "not received within 0.5 s" in message
        status, _ = await send(srv.url + "/v1/completions", json_body({"prompt": "ab"}))
        assert status == 200  # the server serves on


async def test_logprobs_are_finite_json_at_every_allowed_temperature(server: EngineServer) -> None:
    for temperature in (0.0, 1e-4, 1e-3, 1.0, 50.0):
        # ignore_eos: four tokens whatever is sampled (a random model may sample its EOS first)
        body = {"prompt": [8, 79, 8, 87], "max_tokens": 4, "logprobs": 1, "ignore_eos": True}
        async with (
            aiohttp.ClientSession() as s,
            s.post(server.url + "/v1/completions", json={**body, "temperature": temperature}) as r,
        ):
            raw = await r.read()
        assert r.status == 200, raw
        out = msgspec.json.decode(raw)  # strict JSON: NaN would not decode
        logprobs = out["choices"][0]["logprobs"]["token_logprobs"]
        assert len(logprobs) == 4 and all(isinstance(x, float) for x in logprobs)


async def test_dora_clients_send_only_fields_the_server_knows(
    server: EngineServer, client: EngineClient
) -> None:
    """Unknown fields are refused, so every request a dora client makes must decode: EngineClient
    with every sampling field set, and the tau2 user simulator's chat client."""
    from envs.tau2.chat import ChatEndpoint

    params = SamplingParams(
        max_tokens=4,
        min_tokens=1,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        stop=["zz"],
        stop_token_ids=[3],
        ignore_eos=True,
        seed=1,
    )
    done = await client.generate([5, 6, 7], params, request_id="every-field", version=0)
    assert len(done.token_ids) == 4
    endpoint = ChatEndpoint(url=server.url + "/v1", model="tiny", max_tokens=3, timeout_s=30)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    message = await endpoint.complete([{"role": "user", "content": "hi"}], tools=tools)
    assert message["role"] == "assistant"
    assert not set(msgspec.structs.asdict(params)) & api.UNSUPPORTED
