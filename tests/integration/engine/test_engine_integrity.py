"""The engine validates what it imports and loads, and its `/health` tells whether its step loop
runs: an imported request is checked as a completion is (a bad one is a 400 and the requests
decoding beside it never notice); a weight body whose bytes do not fit its shape, or that holds
NaN or inf, is a 400; new weights under the version the engine holds are a 409, the same
weights again an idempotent success; a paused or stalled engine is 503 on `/health`."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from dora.engine import EngineClient, EngineServer
from dora.engine.batcher import BatcherConfig
from dora.errors import RequestError, ServerUnavailable, VersionMismatch
from dora.instance.interface import ExportedRequest
from dora.protocol import SamplingParams

pytestmark = pytest.mark.timeout(120)

Raw = dict[str, tuple[str, list[int], bytes]]


def _raw(folder: Path) -> Raw:
    tensors = load_file(str(folder / "model.safetensors"))
    return {k: ("float32", list(v.shape), v.numpy().tobytes()) for k, v in tensors.items()}


def _imported(request_id: str, **changes: object) -> ExportedRequest:
    """A waiting request as an exporter sends it (no KV yet: the importer prefills it)."""
    req = ExportedRequest(
        request_id=request_id,
        version=0,
        prompt_ids=[5, 6, 7],
        token_ids=[],
        logprobs=[],
        versions=[],
        params=SamplingParams(max_tokens=8, seed=1),
        key=1,
    )
    return msgspec.structs.replace(req, **changes)


async def _health(url: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
        return r.status, await r.json()


async def test_import_out_of_vocab_is_400_and_spares_the_16_requests_decoding_beside_it(
    server: EngineServer, client: EngineClient
) -> None:
    vocab = server.worker.batcher.vocab_size
    params = SamplingParams(max_tokens=120, seed=3, ignore_eos=True)
    beside = [
        asyncio.ensure_future(client.generate([9, 10, 11 + i], params, request_id=f"b{i}"))
        for i in range(16)
    ]
    for _ in range(1500):  # until all 16 decode (30 s at most)
        if (await client.metrics())["running"] >= 16:
            break
        await asyncio.sleep(0.02)
    with pytest.raises(RequestError, match=r"400.*prompt token ids out of range"):
        await client.import_request(_imported("rogue", prompt_ids=[vocab + 5, 6]))
    done = await asyncio.wait_for(asyncio.gather(*beside), 60)
    assert [c.finish_reason for c in done] == ["length"] * 16
    assert all(len(c.token_ids) == 120 for c in done)
    assert (await _health(server.url))[0] == 200


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"params": SamplingParams(max_tokens=-3)}, "max_tokens"),
        ({"params": SamplingParams(max_tokens=0)}, "max_tokens"),
        ({"params": SamplingParams(temperature=1e-9)}, "temperature"),
        ({"params": SamplingParams(temperature=float("nan"))}, "temperature"),
        ({"params": SamplingParams(top_p=0.0)}, "top_p"),
        ({"params": SamplingParams(top_k=-7)}, "top_k"),
        ({"params": SamplingParams(min_tokens=-1)}, "min_tokens"),
        ({"params": SamplingParams(stop_token_ids=[1 << 20])}, "stop_token_ids"),
        ({"params": SamplingParams(seed=-1)}, "seed"),
        ({"key": -1}, "key"),
        ({"key": 1 << 40}, "key"),
        ({"prompt_ids": []}, "prompt is empty"),
        ({"prompt_ids": [-1, 5]}, "prompt token ids out of range"),
        ({"prompt_ids": [1] * 2100}, "does not fit the context"),
        ({"token_ids": [1 << 20], "logprobs": [-0.5], "versions": [0]}, "sampled token ids"),
        ({"token_ids": [3, 4], "logprobs": [-0.5], "versions": [0, 0]}, "as many"),
        ({"token_ids": [3], "logprobs": [float("nan")], "versions": [0]}, "logprobs"),
        ({"token_ids": [3], "logprobs": [-0.1], "versions": [7]}, "versions"),
        (
            {
                "token_ids": [3] * 8,
                "logprobs": [-0.1] * 8,
                "versions": [0] * 8,
                "params": SamplingParams(max_tokens=8),
            },
            "max_tokens",
        ),
    ],
)
async def test_import_out_of_vocab_and_bad_sampling_are_400_naming_the_field(
    server: EngineServer, client: EngineClient, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(RequestError, match=f"400.*{message}"):
        await client.import_request(_imported("bad", **changes))
    good = await client.import_request(_imported("good"))  # the engine is untouched
    assert good.finish_reason in ("length", "stop") and not server.inflight


async def test_load_weights_bytes_that_do_not_fit_the_shape_are_400(
    server: EngineServer, client: EngineClient, tiny_model: Path
) -> None:
    raw = _raw(tiny_model)
    name = next(iter(raw))
    dtype, shape, data = raw[name]
    for bad in [
        (dtype, shape, data[:-4]),  # one float short
        (dtype, shape, data + b"\0\0"),  # not a whole number of floats
        ("bfloat16", shape, data),  # twice the bytes a bfloat16 tensor of this shape holds
        (dtype, [-1, *shape[1:]], data),  # a negative dimension
    ]:
        with pytest.raises(RequestError, match=f"400.*{name}"):
            await client.load_weights(1, tensors={**raw, name: bad})
    assert (await client.health())["version"] == 0


async def test_load_weights_nonfinite_is_400_inline_and_from_a_path(
    server: EngineServer, client: EngineClient, other_weights: Path, tmp_path: Path
) -> None:
    prompt, params = [11, 12, 13], SamplingParams(max_tokens=6, seed=2)
    before = await client.generate(prompt, params, request_id="before")
    raw = _raw(other_weights)
    name = next(iter(raw))
    dtype, shape, data = raw[name]
    poisoned = torch.frombuffer(bytearray(data), dtype=torch.float32).clone()
    for value in (float("nan"), float("inf"), float("-inf")):
        poisoned[3] = value
        bad = {**raw, name: (dtype, shape, poisoned.numpy().tobytes())}
        with pytest.raises(RequestError, match=f"400.*{name}.*not finite"):
            await client.load_weights(1, tensors=bad)
    tensors = load_file(str(other_weights / "model.safetensors"))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    (tmp_path / "nan").mkdir()
    save_file(tensors, str(tmp_path / "nan" / "model.safetensors"))
    with pytest.raises(RequestError, match=f"400.*{name}.*not finite"):
        await client.load_weights(1, path=str(tmp_path / "nan"))
    after = await client.generate(prompt, params, request_id="after")
    assert after.version == 0 and list(after.logprobs) == list(before.logprobs)


async def test_load_weights_same_version_other_weights_is_409_same_weights_idempotent(
    server: EngineServer, client: EngineClient, tiny_model: Path, other_weights: Path
) -> None:
    prompt, params = [11, 12, 13], SamplingParams(max_tokens=6, seed=2)
    before = await client.generate(prompt, params, request_id="before")
    with pytest.raises(VersionMismatch, match=r"version 0 .*other weights"):
        await client.load_weights(0, path=str(other_weights))
    with pytest.raises(VersionMismatch, match=r"version 0 .*other weights"):
        await client.load_weights(0, tensors=_raw(other_weights), mode="abort")
    same = await client.load_weights(0, tensors=_raw(tiny_model))  # a retry: nothing changes
    assert same["version"] == 0 and same["unchanged"] is True
    again = await client.generate(prompt, params, request_id="same")
    assert list(again.logprobs) == list(before.logprobs)

    loaded = await client.load_weights(1, path=str(other_weights))
    assert loaded["version"] == 1 and loaded["unchanged"] is False
    retried = await client.load_weights(1, tensors=_raw(other_weights), mode="abort")
    assert retried["version"] == 1 and retried["unchanged"] is True
    with pytest.raises(VersionMismatch, match=r"version 1 .*other weights"):
        await client.load_weights(1, path=str(tiny_model))
    again = await client.generate(prompt, params, request_id="again")
    assert again.version == 1 and list(again.logprobs) != list(before.logprobs)
    back = await client.load_weights(2, path=str(tiny_model))  # a new version may hold anything
    assert back["version"] == 2


async def test_paused_engine_health_is_503_until_resumed(
    server: EngineServer, client: EngineClient
) -> None:
    status, body = await _health(server.url)
    assert status == 200 and body["status"] == "ok" and body["paused"] is False
    await client.pause()
    status, body = await _health(server.url)
    assert status == 503 and body["status"] == "paused" and body["paused"] is True
    with pytest.raises(ServerUnavailable, match=r"503.*paused"):
        await client.health()
    await client.resume()
    assert (await client.health())["status"] == "ok"


async def test_paused_engine_health_stalled_step_loop_is_503_a_slow_load_is_not(
    tiny_model: Path,
) -> None:
    async with EngineServer.start(
        tiny_model, threads=1, config=BatcherConfig(max_running=8), stall_s=0.3
    ) as srv:
        release = threading.Event()
        stuck = srv.worker.call(lambda b: release.wait(30))  # the engine thread hangs
        await asyncio.sleep(0.6)
        status, body = await _health(srv.url)
        assert status == 503 and body["status"] == "stalled", body
        assert float(body["stalled_s"]) >= 0.3  # type: ignore[arg-type]
        release.set()
        await asyncio.wrap_future(stuck)
        await asyncio.wrap_future(srv.worker.call(lambda b: None))  # the thread turns again
        status, body = await _health(srv.url)
        assert status == 200 and body["status"] == "ok", body

        weights = load_file(str(tiny_model / "model.safetensors"))

        def slow() -> dict[str, torch.Tensor]:
            time.sleep(1.0)
            return weights

        load = srv.worker.load_weights(slow, version=1, mode="drain")
        await asyncio.sleep(0.6)
        status, body = await _health(srv.url)
        assert status == 200 and body["loading"] is True, body
        assert (await asyncio.wrap_future(load))["version"] == 1
