"""`VllmClient` against a fake vLLM server (aiohttp on 127.0.0.1:0) that records the routes it is
called on: runs without vLLM, in the main test job.

Covers what the real-server tests cannot force: the order of a load (pause, worker extension,
prefix-cache reset, version label, resume), a load that fails half-way (the instance is marked
unusable, not left at the old version), requests held during a load, an abort that reaches the
server before its request does (it is repeated), the mapping of vLLM's answer to a `Completion`,
and launcher errors that need no server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from dora.errors import RequestError, ServerError, ServerUnavailable, VersionMismatch
from dora.instance import EngineClient, InstanceClient
from dora.protocol import SamplingParams
from dora.vllm.client import VllmClient
from dora.vllm.launcher import VllmSpec, server_command, server_env

pytestmark = pytest.mark.timeout(30)


@dataclass
class FakeVllm:
    """Completions return one token per 10 ms until max_tokens or an abort of their id."""

    calls: list[str] = field(default_factory=list)
    bodies: list[dict[str, object]] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    fail_load: bool = False
    registered: asyncio.Event = field(default_factory=asyncio.Event)
    ignore_first_abort: bool = False
    adapter_configs: list[dict[str, object]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/collective_rpc", self.rpc)
        for route in ("/pause", "/resume", "/reset_prefix_cache", "/update_weight_version"):
            app.router.add_post(route, self.ok)
        app.router.add_post("/abort_requests", self.abort)
        app.router.add_post("/v1/load_lora_adapter", self.lora)
        app.router.add_post("/v1/unload_lora_adapter", self.lora)
        app.router.add_get("/health", self.health)
        app.router.add_get("/weight_info", self.weight_info)
        app.router.add_route("*", "/{tail:.*}", self.unknown)
        return app

    async def unknown(self, request: web.Request) -> web.Response:
        """A route vLLM does not serve (the embedded engine's, say): recorded, then 404."""
        self.calls.append(f"unknown:{request.path}")
        return web.json_response({"error": {"message": "Not Found"}}, status=404)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "7"})

    async def ok(self, request: web.Request) -> web.Response:
        self.calls.append(request.path_qs)
        return web.json_response({"success": True})

    async def rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(f"rpc:{body['method']}")
        if self.fail_load:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return web.json_response({"results": [{"tensors": 1}]})

    async def lora(self, request: web.Request) -> web.Response:
        """Records `load:<name>:<files in the folder>` or `unload:<name>`."""
        body = await request.json()
        if request.path.endswith("/load_lora_adapter"):
            files = ",".join(sorted(os.listdir(body["lora_path"])))
            self.calls.append(f"load:{body['lora_name']}:{files}")
            self.adapter_configs.append(
                json.loads((Path(body["lora_path"]) / "adapter_config.json").read_text())
            )
        else:
            self.calls.append(f"unload:{body['lora_name']}")
        return web.Response(text="Success")

    async def abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append("abort")
        if self.ignore_first_abort:
            self.ignore_first_abort = False  # this one arrived before its request was known
        else:
            self.aborted.update(body["request_ids"])
        return web.json_response({"aborted": 1})

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.calls.append(f"gen:{body['request_id']}")
        internal = f"cmpl-{body['request_id']}-0"
        tokens: list[int] = []
        self.registered.set()
        finish = "length"
        while len(tokens) < int(body["max_tokens"]):
            if internal in self.aborted:
                finish = "abort"
                break
            tokens.append(len(tokens) + 5)
            await asyncio.sleep(0.01)
        choice = {
            "token_ids": tokens,
            "logprobs": {"token_logprobs": [-1.0] * len(tokens)},
            "finish_reason": finish,
        }
        return web.json_response({"choices": [choice]})


@contextlib.asynccontextmanager
async def serving(server: FakeVllm) -> AsyncIterator[str]:
    """`server` on 127.0.0.1 (a free port) until the block ends; yields its URL."""
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeVllm, VllmClient]]:
    server = FakeVllm()
    async with serving(server) as url:
        client = VllmClient(url, control_timeout_s=5, timeout_s=10)
        try:
            yield server, client
        finally:
            await client.close()


async def test_generate_body_and_completion(fake: tuple[FakeVllm, VllmClient]) -> None:
    server, client = fake
    params = SamplingParams(max_tokens=3, temperature=0.5, top_k=4, seed=9, stop=["x"])
    out = await client.generate([1, 2], params, request_id="r", version=0)
    assert out.token_ids == [5, 6, 7] and out.logprobs == [-1.0] * 3 and out.versions == [0] * 3
    assert out.finish_reason == "length" and out.prompt_tokens == 2
    body = server.bodies[0]
    assert body["prompt"] == [1, 2] and body["request_id"] == "r"
    assert (body["temperature"], body["top_k"], body["seed"], body["stop"]) == (0.5, 4, 9, ["x"])
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"]
    with pytest.raises(VersionMismatch):
        await client.generate([1], params, request_id="r2", version=3)


async def test_load_order_and_version(fake: tuple[FakeVllm, VllmClient]) -> None:
    server, client = fake
    out = await client.load_weights(4, tensors={"w": ("float32", [1], b"\0\0\0\0")})
    assert out["version"] == 4 and out["previous_version"] == 0
    assert server.calls == [
        "/pause?mode=wait",
        "rpc:dora_load_tensors",
        "/reset_prefix_cache?reset_running_requests=true",
        "/update_weight_version",
        "/resume",
    ]
    assert client.version == 4 and (await client.health())["version"] == 4
    await client.load_weights(5, path="/x", mode="abort")
    assert "rpc:dora_load_path" in server.calls
    with pytest.raises(RequestError):
        await client.load_weights(6, path="/x", mode="keep")
    with pytest.raises(RequestError):
        await client.load_weights(6)
    assert await client.read_version() == 7


async def test_tensors_staged_as_safetensors(
    fake: tuple[FakeVllm, VllmClient], tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    from dora.vllm.client import write_safetensors

    server, client = fake
    client.stage_dir = str(tmp_path)
    w = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    b = torch.tensor([1.5, -2.0])
    tensors = {
        "w": ("bfloat16", [2, 3], w.view(torch.uint8).numpy().tobytes()),
        "b": ("float32", [2], b.numpy().tobytes()),
    }
    path = str(tmp_path / "check.safetensors")
    write_safetensors(path, tensors)
    back = load_file(path)
    assert torch.equal(back["w"], w) and torch.equal(back["b"], b)
    await client.load_weights(1, tensors=tensors)
    assert "rpc:dora_load_path" in server.calls
    assert os.listdir(tmp_path) == ["check.safetensors"], "the staged file is removed"


async def test_a_load_cancelled_while_staging_leaves_no_file(
    fake: tuple[FakeVllm, VllmClient], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shutdown cancels loads in flight; the staging write runs on in its thread and its file
    must still go, or every cancelled load leaves a copy of the weights in the run folder."""
    import threading

    from dora.vllm import client as client_module

    started, release, written = threading.Event(), threading.Event(), threading.Event()
    write = client_module.write_safetensors

    def slow_write(path: str, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
        started.set()
        release.wait(5)
        write(path, tensors)
        written.set()

    monkeypatch.setattr(client_module, "write_safetensors", slow_write)
    _, client = fake
    client.stage_dir = str(tmp_path)
    load = asyncio.ensure_future(
        client.load_weights(1, tensors={"w": ("float32", [1], b"\0\0\0\0")})
    )
    await asyncio.to_thread(started.wait, 5)
    load.cancel()
    with pytest.raises(asyncio.CancelledError):
        await load
    release.set()
    await asyncio.to_thread(written.wait, 5)
    for _ in range(200):
        if not os.listdir(tmp_path):
            break
        await asyncio.sleep(0.01)
    assert os.listdir(tmp_path) == [], "the cancelled load's staged file is removed"


async def test_failed_load_leaves_instance_unusable(fake: tuple[FakeVllm, VllmClient]) -> None:
    server, client = fake
    server.fail_load = True
    with pytest.raises(ServerError):
        await client.load_weights(1, path="/x")
    assert client.version == -1, "half-loaded weights must not pass for version 0"
    with pytest.raises(VersionMismatch):
        await client.generate([1], SamplingParams(max_tokens=1), request_id="r", version=0)
    server.fail_load = False
    await client.load_weights(1, path="/x")
    assert client.version == 1


async def test_generate_waits_for_a_load(fake: tuple[FakeVllm, VllmClient]) -> None:
    server, client = fake
    params = SamplingParams(max_tokens=20)
    running = asyncio.create_task(client.generate([1], params, request_id="old", version=0))
    await server.registered.wait()
    load = asyncio.create_task(client.load_weights(1, path="/x"))
    await asyncio.sleep(0)
    queued = asyncio.create_task(client.generate([1], params, request_id="new", version=1))
    old, _, new = await asyncio.gather(running, load, queued)
    assert old.versions == [0] * 20 and new.versions == [1] * 20
    assert server.calls.index("gen:new") > server.calls.index("/resume")


async def test_abort_mode_load_stops_running_requests(
    fake: tuple[FakeVllm, VllmClient],
) -> None:
    server, client = fake
    server.ignore_first_abort = True  # the request is still on its way when the load starts
    call = asyncio.create_task(
        client.generate([1], SamplingParams(max_tokens=1000), request_id="r", version=0)
    )
    await asyncio.sleep(0)
    loaded = await client.load_weights(1, path="/x", mode="abort")
    stopped = await call
    assert loaded["aborted"] == 1 and stopped.finish_reason == "abort"
    assert 0 < len(stopped.token_ids) < 1000 and stopped.versions == [0] * len(stopped.token_ids)
    assert server.calls.index("/pause?mode=wait") > server.calls.index("gen:r")


async def test_abort_returns_tokens_so_far_and_repeats(fake: tuple[FakeVllm, VllmClient]) -> None:
    server, client = fake
    server.ignore_first_abort = True
    call = asyncio.create_task(
        client.generate([1], SamplingParams(max_tokens=1000), request_id="a", version=0)
    )
    await server.registered.wait()
    aborted = await client.abort("a")
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 1000
    assert server.calls.count("abort") == 2, "the first abort missed; it was repeated"
    assert (await call) == aborted
    with pytest.raises(RequestError):
        await client.abort("a")
    with pytest.raises(RequestError):  # no KV export; it aborts instead
        await client.export_request("a")


def test_vllm_client_implements_the_interface_itself() -> None:
    """Every method of the instance interface is written for vLLM, none inherited from the
    embedded engine's client: what vLLM lacks cannot be a forgotten override."""
    assert not issubclass(VllmClient, EngineClient)
    members = [name for name in vars(InstanceClient) if not name.startswith("_")]
    assert {"generate", "load_weights", "unload_weights", "release_session"} <= set(members)
    for name in members:
        owner = next(c for c in VllmClient.__mro__ if name in vars(c))
        assert owner.__module__.startswith("dora.vllm"), (name, owner)


async def test_vllm_client_calls_no_route_vllm_lacks(fake: tuple[FakeVllm, VllmClient]) -> None:
    """A full-weight vLLM client holds one version: unload is refused without a call, a session
    is nothing to release, and there is no engine thread to move to the background."""
    server, client = fake
    with pytest.raises(RequestError, match="one version"):
        await client.unload_weights(0)
    client.release_session("s")
    await client.generate([1], SamplingParams(max_tokens=1), request_id="r", version=0)
    await client.health()
    assert not hasattr(client, "set_background")
    assert [c for c in server.calls if c.startswith("unknown:")] == []


async def test_unreachable_server() -> None:
    async with VllmClient("http://127.0.0.1:9", control_timeout_s=2) as client:
        with pytest.raises(ServerUnavailable):
            await client.health()


def test_server_command_and_env() -> None:
    spec = VllmSpec(
        model_dir="/m",
        python="/venv/bin/python",
        max_model_len=256,
        tensor_parallel_size=2,
        extra_args=("--gpu-memory-utilization", "0.8"),
    )
    cmd = server_command(spec, 8000)
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for flag in (
        "--logprobs-mode processed_logprobs",
        "--worker-extension-cls dora.vllm.worker_ext.WeightLoaderExt",
        "--port 8000",
        "--max-model-len 256",
        "--tensor-parallel-size 2",
    ):
        assert flag in joined
    assert cmd[-2:] == ["--gpu-memory-utilization", "0.8"]
    assert server_command(spec, 8000, bootstrap=True)[1] == "-c"
    gpus = VllmSpec(model_dir="/m", devices=("0,1", "2,3"), env={"X": "1"})
    env = server_env(gpus, 1)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["X"] == "1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"


def test_config_reaches_the_vllm_spec() -> None:
    from dora.config import load_config
    from dora.vllm.launcher import spec_from_config

    config = load_config(
        None,
        [
            "serve.backend=vllm",
            "serve.vllm_python=/opt/vllm/bin/python",
            "serve.vllm_args=['--gpu-memory-utilization', '0.85']",
            "serve.vllm_devices=['0,1', '2,3']",
            "serve.vllm_tensor_parallel=2",
            "serve.stage_dir=/shared/stage",
            "learn.devices='4'",
        ],
    )
    from dora.gpu_plan import PINNED, plan_gpus

    plan = plan_gpus(config, tuple(map(str, range(8))), PINNED)
    spec = spec_from_config(config, "/models/m", plan=plan)
    assert spec.python == "/opt/vllm/bin/python"
    assert tuple(spec.extra_args) == ("--gpu-memory-utilization", "0.85")
    assert tuple(spec.devices) == ("0,1", "2,3") and spec.tensor_parallel_size == 2
    assert spec.stage_dir == "/shared/stage"
    cpu = plan_gpus(load_config(None), (), PINNED)
    assert spec_from_config(load_config(None), "/m", plan=cpu).python is None


async def test_adapter_versions_load_beside_each_other_and_pin_by_name(tmp_path: Path) -> None:
    """A LoRA instance: loads add adapters without pausing anything, a generate names its
    version's adapter (version 0: none), held versions come back in `health`, unloads drop them
    and the folders the client staged."""
    from dora.vllm.adapters import VllmAdapterClient, write_adapter_folder

    server = FakeVllm()
    stage = tmp_path / "stage"
    stage.mkdir()
    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {
        f"{layer}.lora_A.weight": ("float32", [8, 16], bytes(4 * 8 * 16)),
        f"{layer}.lora_B.weight": ("float32", [16, 8], bytes(4 * 16 * 8)),
    }
    published = tmp_path / "v000001"  # as the filesystem transport publishes a version
    published.mkdir()
    write_adapter_folder(str(published), tensors)
    async with serving(server) as url:
        client = VllmAdapterClient(url, control_timeout_s=5, timeout_s=10, stage_dir=str(stage))
        try:
            params = SamplingParams(max_tokens=30)
            running = asyncio.create_task(client.generate([1], params, request_id="r0", version=0))
            await server.registered.wait()
            await client.load_weights(1, path=str(published))
            await client.load_weights(2, tensors=tensors)
            assert not running.done(), "an adapter load waits for nothing running"
            assert server.calls[1:] == [
                "load:dora-v1:adapter_config.json,adapter_model.safetensors",
                "load:dora-v2:adapter_config.json,adapter_model.safetensors",
            ]
            config = server.adapter_configs[-1]
            assert (config["r"], config["lora_alpha"]) == (8, 8)
            assert config["target_modules"] == ["q_proj"]
            assert (await client.health())["versions"] == [0, 1, 2] and client.version == 2
            one = await client.generate(
                [1], SamplingParams(max_tokens=2), request_id="r1", version=1
            )
            assert one.versions == [1, 1] and (await running).versions == [0] * 30
            assert "model" not in server.bodies[0] and server.bodies[1]["model"] == "dora-v1"
            assert len(os.listdir(stage)) == 1, "a staged adapter stays while vLLM may reread it"

            with pytest.raises(VersionMismatch):
                await client.unload_weights(2)  # the newest is kept
            await client.unload_weights(1)
            assert (await client.health())["versions"] == [0, 2]
            with pytest.raises(VersionMismatch):
                await client.generate([1], params, request_id="r2", version=1)
            await client.load_weights(3, tensors=tensors)
            await client.unload_weights(2)
            assert server.calls[-1] == "unload:dora-v2"
            assert (await client.health())["versions"] == [0, 3]
            assert len(os.listdir(stage)) == 1, "version 2's staged folder went with it"
        finally:
            await client.close()
