"""Where servers bind and what they demand off loopback: the address rule, and the vLLM launcher
(which never exposes vLLM's unauthenticated dev-mode routes and hands the token to its servers and
clients). The link and the engine have their own tests (test_link.py, engine/test_bad_input.py)."""

from __future__ import annotations

import os

import pytest
from aiohttp import web

from dora.config import DoraConfig, ServeConfig
from dora.errors import ConfigError
from dora.gpu_plan import PINNED, plan_gpus
from dora.net import is_loopback
from dora.vllm.launcher import VllmSpec, attach, server_command, server_env, spec_from_config

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("", False),
        ("::", False),
        ("10.1.2.3", False),
        ("node7.cluster", False),
    ],
)
def test_loopback_means_this_machine_only(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


async def test_vllm_launcher_refuses_an_off_loopback_server() -> None:
    from dora.vllm.launcher import start_server

    with pytest.raises(ConfigError, match=r"'0\.0\.0\.0'.*dev-mode routes.*serve\.urls"):
        await start_server(VllmSpec(model_dir="unused", host="0.0.0.0", python="unused"), "i0")


def test_vllm_servers_bind_loopback_and_get_the_token_out_of_sight() -> None:
    config = DoraConfig(serve=ServeConfig(host="0.0.0.0", token="s3cret", backend="vllm"))
    spec = spec_from_config(config, "model", plan=plan_gpus(config, (), PINNED))
    assert spec.host == "127.0.0.1" and spec.token == "s3cret"
    command = server_command(VllmSpec(model_dir="m", python="py", token="s3cret"), 8000)
    assert "s3cret" not in " ".join(command)  # `ps` would show it
    assert server_env(VllmSpec(model_dir="m", token="s3cret"))["VLLM_API_KEY"] == "s3cret"
    untouched = server_env(VllmSpec(model_dir="m")).get("VLLM_API_KEY")
    assert untouched == os.environ.get("VLLM_API_KEY")  # no token: dora sets none


async def test_vllm_clients_send_the_token() -> None:
    seen: list[str] = []

    async def health(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.Response()

    async def weight_info(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response({"weight_version": "0"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/weight_info", weight_info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        spec = VllmSpec(model_dir="m", token="s3cret", control_timeout_s=5)
        async with attach([f"http://127.0.0.1:{port}"], spec) as handles:
            assert len(handles) == 1
    finally:
        await runner.cleanup()
    assert seen and all(h == "Bearer s3cret" for h in seen)
