"""A weight transfer that stalls (docs/reliability.md): the load times out, the error names the
instance, the version and what was sent, and the load is retried; the run loses nothing.

The stall is real network behaviour: a loopback HTTP proxy in front of one engine forwards every
request, but holds the first load of a trained version longer than `serve.weight_load_timeout_s`
(as a hung transfer would), so dora's HTTP client gives up on it. Engines are attached through
`serve.urls`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from serve_helpers import on_free_port
from serve_trainer import ToyTrainer

from dora.config import load_config
from dora.serve.instances import InstanceSpec, start_in_process
from dora.serve.main import run_serve

pytestmark = pytest.mark.timeout(180)

STEPS, B, TIMEOUT_S = 8, 2, 2.0


@asynccontextmanager
async def stalling_proxy(upstream: str, stall_s: float) -> AsyncIterator[tuple[str, list[int]]]:
    """A proxy to `upstream` that holds the first load of a version >= 1 for `stall_s`; yields its
    URL and the versions it stalled."""
    stalled: list[int] = []
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/control/load_weights" and not stalled and b"version" in body:
            import msgspec

            version = int(msgspec.msgpack.decode(body, type=dict)["version"])
            if version >= 1:
                stalled.append(version)
                await asyncio.sleep(stall_s)  # the client's deadline passes first
        headers = {k: v for k, v in request.headers.items() if k.lower() == "content-type"}
        async with session.request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as up:
            data = await up.read()
            ctype = up.headers.get("Content-Type", "application/octet-stream")
            return web.Response(status=up.status, body=data, headers={"Content-Type": ctype})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", stalled
    finally:
        await runner.cleanup()
        await session.close()


@pytest.mark.slow
async def test_a_stalled_weight_load_times_out_and_is_retried(
    tmp_path: Path, long_tail_model: Path
) -> None:
    spec = InstanceSpec(model_dir=str(long_tail_model), max_running=8, max_model_len=256)
    async with (
        start_in_process(spec, 2) as engines,
        stalling_proxy(engines[0].url, stall_s=TIMEOUT_S + 1.5) as (proxy, stalled),
    ):
        config = load_config(
            None,
            [
                f"model.path={json.dumps(str(long_tail_model))}",
                "model.max_model_len=256",
                f"serve.urls={json.dumps([proxy, engines[1].url])}",
                "serve.max_running=8",
                "serve.request_timeout_s=60",
                f"serve.weight_load_timeout_s={TIMEOUT_S}",
                "serve.weight_load_retries=2",
                "rollout.staleness=1",
                "rollout.group_size=2",
                f"rollout.batch_size={B}",
                "rollout.max_tokens=16",
                "rollout.max_turns=1",
                f"learn.steps={STEPS}",
                f"log.run_dir={json.dumps(str(tmp_path))}",
                "log.progress=false",
            ],
        )
        config, address = on_free_port(config)
        # slow steps: the run outlasts the stalled load and its retry
        trainer = ToyTrainer(
            address, model_dir=long_tail_model, steps=STEPS, batch_size=B, step_time_s=0.8
        )
        trainer.start()
        report = await asyncio.wait_for(run_serve(config, run_dir=tmp_path), 150)
        await asyncio.to_thread(trainer.join)

    assert stalled, "the proxy held a load"
    records = [json.loads(x) for x in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    timeouts = [r for r in records if r["kind"] == "weight_load_timeout"]
    assert len(timeouts) == 1, timeouts
    t = timeouts[0]
    assert (t["instance"], t["version"], t["attempt"]) == ("i0", stalled[0], 1)
    assert f"version {stalled[0]}" in t["error"] and "i0" in t["error"], t["error"]
    assert "within 2 s" in t["error"], "the error says how long it waited"
    # the retry loaded that version on the same instance, which never counted as dead
    loads = [r for r in records if r["kind"] == "weight_load" and r["instance"] == "i0"]
    assert stalled[0] in [r["version"] for r in loads]
    assert not [r for r in records if r["kind"] == "instance_failed"]
    assert report.extra["weight_load_retries"] == 1  # type: ignore[attr-defined]
    ids = [g.id for _, g in trainer.received]
    assert trainer.trained == list(range(STEPS)) and len(ids) == len(set(ids)) == STEPS * B
