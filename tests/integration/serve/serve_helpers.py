"""How the serve tests run `dora serve`: its trainer link on a port known before it starts, and
engines in this process attached through `serve.urls` (the path `dora serve` takes for instances
it did not start)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from dora.config import DoraConfig
from dora.models.prepare import prepare_model
from dora.net import free_port
from dora.serve.instances import InstanceSpec, start_in_process
from dora.serve.main import run_serve


def on_free_port(config: DoraConfig) -> tuple[DoraConfig, str]:
    """`config` with its trainer link on a free loopback port, and the address a trainer connects
    to (known before `run_serve` binds it)."""
    port = free_port("127.0.0.1")
    serve = msgspec.structs.replace(config.serve, host="127.0.0.1", port=port)
    return msgspec.structs.replace(config, serve=serve), f"tcp://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def engines_in_process(config: DoraConfig) -> AsyncIterator[DoraConfig]:
    """`serve.instances` engines of the run's initial model in this process (they start in a
    fraction of a process's time), and `config` attaching them through `serve.urls`: the path
    `dora serve` takes for instances it did not start (it replaces none of them)."""
    assert not config.serve.urls, "serve.urls already names the instances: call run_serve"
    model_dir = await asyncio.to_thread(prepare_model, config)
    spec = InstanceSpec.from_config(config, model_dir)
    async with start_in_process(spec, config.serve.instances) as handles:
        serve = msgspec.structs.replace(config.serve, urls=[h.url for h in handles])
        yield msgspec.structs.replace(config, serve=serve)


async def serve_in_process(config: DoraConfig, *, run_dir: Path, **kwargs: object) -> object:
    """`run_serve` on engines started in this process (`engines_in_process`)."""
    async with engines_in_process(config) as attached:
        return await run_serve(attached, run_dir=run_dir, **kwargs)  # type: ignore[arg-type]


async def serve_started(run_dir: Path, *, starts: int, timeout_s: float = 60.0) -> None:
    """Wait until the run's `rollout.jsonl` holds `starts` `serve_start` records: the serve that
    wrote the last one has bound its trainer link."""
    path = run_dir / "rollout.jsonl"
    async with asyncio.timeout(timeout_s):
        while True:
            if path.exists():
                lines = path.read_text().splitlines()
                if sum('"kind":"serve_start"' in line for line in lines) >= starts:
                    return
            await asyncio.sleep(0.05)
