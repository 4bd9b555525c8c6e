"""The engine over real HTTP on 127.0.0.1: OpenAI endpoints, versions, control, migration."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dora.engine import EngineClient, EngineServer
from dora.errors import RequestError, VersionMismatch
from dora.protocol import Completion, SamplingParams

pytestmark = pytest.mark.timeout(60)


def forward_logprobs(
    model_dir: Path, prompt: list[int], tokens: Sequence[int], temperature: float = 1.0
) -> list[float]:
    tokens = list(tokens)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


async def post(url: str, body: dict[str, object]) -> tuple[int, dict[str, object], str]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json(), r.headers.get("X-Dora-Version", "")


async def stream_tokens(
    url: str, body: dict[str, object], until: int, got: asyncio.Event
) -> list[dict]:
    """Stream a completion; set `got` once `until` tokens have arrived; return every chunk."""
    chunks: list[dict] = []
    n = 0
    async with aiohttp.ClientSession() as s, s.post(url, json={**body, "stream": True}) as r:
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            n += len(chunk["choices"][0].get("token_ids", [])) if chunk.get("choices") else 0
            if n >= until:
                got.set()
    return chunks


async def test_completion_text_prompt_carries_version(server: EngineServer) -> None:
    status, body, header = await post(
        server.url + "/v1/completions",
        {"prompt": "hello", "max_tokens": 5, "ignore_eos": True, "seed": 1},
    )
    assert status == 200, body
    assert body["version"] == 0 and header == "0"
    choice = body["choices"][0]  # type: ignore[index]
    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    assert body["usage"]["completion_tokens"] == 5  # type: ignore[index]


async def test_completions_answer_in_msgpack_when_asked(server: EngineServer) -> None:
    """dora's client asks for msgpack (`Accept`): the same answer as the JSON one, in msgpack, with
    the sampled tokens, log-probs and versions as raw little-endian int32 / float32 bytes."""
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "seed": 2, "logprobs": 0}
    body["return_token_ids"] = True
    url = server.url + "/v1/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body) as r:
            as_json = await r.json()
        headers = {"Accept": "application/msgpack"}
        async with s.post(url, json=body, headers=headers) as r:
            assert r.content_type == "application/msgpack" and r.headers["X-Dora-Version"] == "0"
            as_msgpack = msgspec.msgpack.decode(await r.read())
    for answer in (as_json, as_msgpack):
        answer.pop("id"), answer.pop("created")
    packed = as_msgpack["choices"][0]
    packed["token_ids"] = np.frombuffer(packed["token_ids"], "<i4").tolist()
    packed["versions"] = np.frombuffer(packed["versions"], "<i4").tolist()
    lps = packed["logprobs"]["token_logprobs"]
    packed["logprobs"]["token_logprobs"] = np.frombuffer(lps, "<f4").tolist()
    assert as_msgpack == as_json and len(as_json["choices"][0]["token_ids"]) == 6


async def test_logprobs_match_a_forward_pass(client: EngineClient, tiny_model: Path) -> None:
    prompt = list(range(10, 30))
    for temperature in (1.0, 0.7):
        params = SamplingParams(max_tokens=40, temperature=temperature, seed=3, ignore_eos=True)
        out = await client.generate(prompt, params, request_id=f"lp-{temperature}")
        assert len(out.token_ids) == 40 and list(out.versions) == [0] * 40
        ref = forward_logprobs(tiny_model, prompt, out.token_ids, temperature)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref, strict=True)) < 1e-4


async def test_unknown_fields_are_a_400_naming_them(server: EngineServer) -> None:
    status, body, _ = await post(
        server.url + "/v1/completions", {"prompt": "a", "max_token": 3, "tempature": 1}
    )
    assert status == 400
    assert "max_token" in body["error"]["message"] and "tempature" in body["error"]["message"]  # type: ignore[index]
    status, body, _ = await post(server.url + "/v1/chat/completions", {"messages": [], "foo": 1})
    assert status == 400 and "foo" in body["error"]["message"]  # type: ignore[index]
    status, body, _ = await post(server.url + "/v1/completions", {"prompt": "a", "temperature": -1})
    assert status == 400


async def test_64_concurrent_clients_get_independent_answers(
    server: EngineServer, client: EngineClient
) -> None:
    def params(i: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=8 + (i * 7) % 40,
            seed=i,
            ignore_eos=i % 2 == 0,
            temperature=0.5 + i % 3 * 0.5,
        )

    prompts = [[20 + i % 50, 30 + i % 7, 40] for i in range(64)]

    async def one_client(i: int) -> Completion:
        async with EngineClient(server.url, timeout_s=60) as own:
            return await own.generate(prompts[i], params(i), request_id=f"c{i}")

    together = await asyncio.gather(*(one_client(i) for i in range(64)))
    assert all(len(c.token_ids) > 0 for c in together)
    for i in range(0, 64, 4):
        alone = await client.generate(prompts[i], params(i), request_id=f"a{i}")
        assert list(alone.token_ids) == list(together[i].token_ids)
        assert (
            max(abs(a - b) for a, b in zip(alone.logprobs, together[i].logprobs, strict=True))
            < 1e-4
        )


async def test_n_samples_differ_and_seeds_repeat(server: EngineServer) -> None:
    body = {
        "prompt": [5, 6, 7],
        "n": 3,
        "max_tokens": 20,
        "seed": 7,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    _, first, _ = await post(server.url + "/v1/completions", body)
    _, again, _ = await post(server.url + "/v1/completions", body)
    ids = [c["token_ids"] for c in first["choices"]]  # type: ignore[union-attr]
    assert len({tuple(x) for x in ids}) == 3
    assert ids == [c["token_ids"] for c in again["choices"]]  # type: ignore[union-attr]


async def test_stop_strings_and_stop_token_ids(server: EngineServer) -> None:
    url = server.url + "/v1/completions"
    base = {
        "prompt": "abc",
        "max_tokens": 40,
        "seed": 11,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    _, free, _ = await post(url, base)
    text = free["choices"][0]["text"]  # type: ignore[index]
    ids = free["choices"][0]["token_ids"]  # type: ignore[index]
    stop = text[10:12]
    _, cut, _ = await post(url, {**base, "stop": [stop]})
    choice = cut["choices"][0]  # type: ignore[index]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[: text.find(stop)]
    _, by_id, _ = await post(url, {**base, "stop_token_ids": [ids[5]]})
    choice = by_id["choices"][0]  # type: ignore[index]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == ids[: ids.index(ids[5]) + 1]


async def test_streaming_equals_non_streaming(server: EngineServer) -> None:
    url = server.url + "/v1/completions"
    body = {
        "prompt": "xyz",
        "max_tokens": 30,
        "seed": 5,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 0,
    }
    _, whole, _ = await post(url, body)
    chunks = await stream_tokens(url, body, 10**9, asyncio.Event())
    text = "".join(c["choices"][0]["text"] for c in chunks)
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert text == whole["choices"][0]["text"]  # type: ignore[index]
    assert ids == whole["choices"][0]["token_ids"]  # type: ignore[index]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_abort_returns_tokens_so_far(server: EngineServer, client: EngineClient) -> None:
    got = asyncio.Event()
    body = {"prompt": "long", "max_tokens": 1500, "ignore_eos": True, "request_id": "victim"}
    streaming = asyncio.ensure_future(
        stream_tokens(server.url + "/v1/completions", {**body, "return_token_ids": True}, 5, got)
    )
    await asyncio.wait_for(got.wait(), 20)
    aborted = await client.abort("victim")
    assert aborted.finish_reason == "abort" and 5 <= len(aborted.token_ids) < 1500
    chunks = await asyncio.wait_for(streaming, 20)
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == list(aborted.token_ids)
    with pytest.raises(RequestError):
        await client.abort("never-seen")


async def test_weight_load_changes_version_and_logprobs(
    client: EngineClient, tiny_model: Path, other_weights: Path
) -> None:
    prompt, params = [11, 12, 13, 14], SamplingParams(max_tokens=12, seed=2, ignore_eos=True)
    before = await client.generate(prompt, params, request_id="w0")
    result = await client.load_weights(1, path=str(other_weights), mode="drain")
    assert result["version"] == 1 and result["previous_version"] == 0
    assert (await client.health())["version"] == 1
    after = await client.generate(prompt, params, request_id="w1")
    assert list(after.versions) == [1] * 12
    ref = forward_logprobs(other_weights, prompt, after.token_ids)
    assert max(abs(a - b) for a, b in zip(after.logprobs, ref, strict=True)) < 1e-4
    assert after.logprobs != before.logprobs
    with pytest.raises(VersionMismatch):
        await client.generate(prompt, params, request_id="w2", version=0)
    # raw tensor bytes: back to the first weights, as version 2
    from safetensors.torch import load_file

    tensors = load_file(str(tiny_model / "model.safetensors"))
    raw = {k: ("float32", list(v.shape), v.numpy().tobytes()) for k, v in tensors.items()}
    await client.load_weights(2, tensors=raw, mode="abort")
    again = await client.generate(prompt, params, request_id="w3", version=2)
    assert list(again.token_ids) == list(before.token_ids) and list(again.versions) == [2] * 12


async def test_abort_mode_load_ends_in_flight_requests(
    server: EngineServer, client: EngineClient, other_weights: Path
) -> None:
    got = asyncio.Event()
    body = {
        "prompt": "x",
        "max_tokens": 1500,
        "ignore_eos": True,
        "request_id": "inflight",
        "return_token_ids": True,
    }
    streaming = asyncio.ensure_future(stream_tokens(server.url + "/v1/completions", body, 3, got))
    await asyncio.wait_for(got.wait(), 20)
    result = await client.load_weights(5, path=str(other_weights), mode="abort")
    assert result["aborted"] == ["inflight"]
    chunks = await asyncio.wait_for(streaming, 20)
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert {c["version"] for c in chunks} == {0}


async def test_migration_continues_bit_identically(tiny_model: Path) -> None:
    params = SamplingParams(max_tokens=80, seed=42, ignore_eos=True, temperature=0.9)
    prompt = list(range(20, 40))
    async with (
        EngineServer.start(tiny_model, version=0, threads=1) as a,
        EngineServer.start(tiny_model, version=0, threads=1) as b,
        EngineClient(a.url) as ca,
        EngineClient(b.url) as cb,
    ):
        reference = await ca.generate(prompt, params, request_id="ref")
        got = asyncio.Event()
        body = {
            "prompt": prompt,
            "max_tokens": 80,
            "seed": 42,
            "ignore_eos": True,
            "temperature": 0.9,
        }
        body.update(request_id="mover", return_token_ids=True)
        # a bystander admitted after the mover: exporting the mover moves the bystander's KV row
        bystander_params = SamplingParams(max_tokens=120, seed=7, ignore_eos=True)
        bystander_ref = await ca.generate(prompt[:5], bystander_params, request_id="by-ref")
        streaming = asyncio.ensure_future(stream_tokens(a.url + "/v1/completions", body, 10, got))
        bystander = asyncio.ensure_future(
            ca.generate(prompt[:5], bystander_params, request_id="bystander")
        )
        await asyncio.wait_for(got.wait(), 20)
        exported = await ca.export_request("mover")
        bystander_done = await asyncio.wait_for(bystander, 30)
        assert list(bystander_done.token_ids) == list(bystander_ref.token_ids)
        assert 10 <= len(exported.token_ids) < 80 and exported.kv
        chunks = await asyncio.wait_for(streaming, 20)
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        bad = msgspec.structs.replace(exported, kv_shape=[1, *exported.kv_shape[1:]])
        with pytest.raises(RequestError, match="cannot import"):
            await cb.import_request(bad)
        moved: Completion = await cb.import_request(exported)
        assert list(moved.token_ids) == list(reference.token_ids)
        assert moved.finish_reason == "length"
        assert (
            max(abs(x - y) for x, y in zip(moved.logprobs, reference.logprobs, strict=True)) < 1e-5
        )
        await cb.load_weights(3, path=str(tiny_model))
        with pytest.raises(VersionMismatch):
            await cb.import_request(exported)


async def test_chat_completion_and_models(server: EngineServer) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": tools,
        "max_tokens": 10,
        "seed": 1,
    }
    status, out, header = await post(server.url + "/v1/chat/completions", body)
    assert status == 200 and header == "0" and out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"  # type: ignore[index]
    async with aiohttp.ClientSession() as s, s.get(server.url + "/v1/models") as r:
        models = await r.json()
    assert models["data"][0]["version"] == 0


async def test_health_metrics_pause_resume(server: EngineServer, client: EngineClient) -> None:
    assert (await client.health())["status"] == "ok"
    await client.pause()
    pending = asyncio.ensure_future(
        client.generate([1, 2, 3], SamplingParams(max_tokens=4), request_id="p")
    )
    await asyncio.sleep(0.2)  # give the paused engine a chance to (wrongly) run it
    metrics = await client.metrics()
    assert metrics["paused"] is True and metrics["waiting"] == 1 and not pending.done()
    await client.resume()
    done = await asyncio.wait_for(pending, 20)
    assert len(done.token_ids) <= 4
    metrics = await client.metrics()
    for key in ("running", "waiting", "tokens_per_s", "kv_use", "kv_used_tokens", "version"):
        assert key in metrics


async def test_control_needs_token_when_configured(tiny_model: Path) -> None:
    async with EngineServer.start(tiny_model, control_token="s3cret") as srv:
        async with EngineClient(srv.url) as anonymous:
            with pytest.raises(RequestError, match="401"):
                await anonymous.pause()
        async with EngineClient(srv.url, token="s3cret") as trusted:
            await trusted.pause()
            await trusted.resume()


async def test_request_size_limit(tiny_model: Path) -> None:
    async with EngineServer.start(tiny_model, max_request_bytes=1000) as srv:
        status, _, _ = await post(srv.url + "/v1/completions", {"prompt": "a" * 5000})
        assert status == 413


async def test_keep_mode_load_continues_in_flight_under_new_weights(
    server: EngineServer, client: EngineClient, other_weights: Path
) -> None:
    got = asyncio.Event()
    body = {"prompt": "x", "max_tokens": 300, "ignore_eos": True, "return_token_ids": True}
    streaming = asyncio.ensure_future(
        stream_tokens(server.url + "/v1/completions", {**body, "request_id": "kept"}, 3, got)
    )
    await asyncio.wait_for(got.wait(), 20)
    result = await client.load_weights(1, path=str(other_weights), mode="keep")
    assert result["aborted"] == []
    chunks = await asyncio.wait_for(streaming, 30)
    versions = [v for c in chunks for v in c["choices"][0]["versions"]]
    assert len(versions) == 300 and versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_streaming(server: EngineServer) -> None:
    url = server.url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "seed": 4}
    _, whole, _ = await post(url, body)
    chunks = await stream_tokens(url, body, 10**9, asyncio.Event())
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]  # type: ignore[index]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    held = await stream_tokens(url, {**body, "tools": tools}, 10**9, asyncio.Event())
    assert len(held) == 1 and held[0]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_bad_prompts_are_400(server: EngineServer) -> None:
    url = server.url + "/v1/completions"
    assert (await post(url, {"prompt": [10**6]}))[0] == 400
    assert (await post(url, {"prompt": [1] * 3000, "max_tokens": 1}))[0] == 400
    status, body, _ = await post(url, {"prompt": [1, 2], "request_id": "dup", "max_tokens": 1})
    assert status == 200, body


async def test_client_errors_map_to_dora_errors(server: EngineServer, client: EngineClient) -> None:
    from dora.errors import ServerTimeout, ServerUnavailable

    await client.pause()
    with pytest.raises(ServerTimeout):
        await client.generate([1, 2], SamplingParams(max_tokens=2), request_id="t", timeout_s=0.3)
    await client.resume()
    async with EngineClient("http://127.0.0.1:9") as nowhere:
        with pytest.raises(ServerUnavailable):
            await nowhere.health()


@pytest.mark.parametrize(
    "answer",
    [
        b'{"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [NaN]}}]}',
        b"<html>proxy error</html>",
        b'{"choices": []}',
        b'{"choices": [{"token_ids": ["a"], "logprobs": {"token_logprobs": [0.1]}, '
        b'"versions": [0], "finish_reason": "stop"}]}',
        b"[" * 100_000,
    ],
)
async def test_an_answer_that_does_not_decode_is_a_protocol_error(answer: bytes) -> None:
    from aiohttp import web

    from dora.errors import ProtocolError

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.add_routes([web.post("/v1/completions", handler), web.get("/health", handler)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with EngineClient(f"http://{host}:{port}", multiplex=False) as c:  # HTTP answers
            with pytest.raises(ProtocolError, match=r"generate: http://127\.0\.0\.1"):
                await c.generate([1, 2], SamplingParams(max_tokens=1), request_id="x")
            if not answer.startswith(b"{"):
                with pytest.raises(ProtocolError, match="health"):
                    await c.health()
    finally:
        await runner.cleanup()


async def test_the_client_does_not_cap_calls_in_flight_so_a_probe_never_queues() -> None:
    """aiohttp caps a session at 100 connections by default: past that, calls (and the health
    probe that must notice a hung instance) would queue inside the client."""
    from aiohttp import web

    inside, all_in = 0, asyncio.Event()
    n = 130

    async def slow(request: web.Request) -> web.Response:
        nonlocal inside
        inside += 1
        if inside == n:
            all_in.set()
        await all_in.wait()
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.add_routes([web.get("/health", slow)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        async with EngineClient(f"http://{host}:{port}") as c:
            answers = await asyncio.gather(*(c.health(timeout_s=30) for _ in range(n)))
        assert all(a["status"] == "ok" for a in answers)
    finally:
        await runner.cleanup()


async def test_the_multiplexed_connection_needs_the_control_token(tiny_model: Path) -> None:
    from dora.errors import RequestError

    params = SamplingParams(max_tokens=2, seed=1)
    async with EngineServer.start(tiny_model, control_token="s3cret") as srv:
        async with EngineClient(srv.url, token="wrong") as bad:
            with pytest.raises(RequestError, match="refused the connection"):
                await bad.generate([1, 2], params, request_id="a")
        async with EngineClient(srv.url, token="s3cret") as good:
            out = await good.generate([1, 2], params, request_id="b")
            assert len(out.token_ids) == 2 and good.mux.connects == 1
