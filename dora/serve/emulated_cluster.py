"""`serve.backend = "emulated"`: serve's side of the emulated cluster.

`emulated_instances(config, model_dir, count=N)` starts one `python -m dora.emulated` process of N
instances (see `dora.emulated.cluster`), reads their URLs within `serve.weight_load_timeout_s`,
hands out `InstanceHandle`s with ordinary `EngineClient`s, and stops the process (SIGTERM, a
bounded wait, SIGKILL) on exit. Every instance starts holding version 0. The URLs also go to
`emulated-urls.txt` in the run directory: a colocated emulated trainer pauses the instances there
while it trains (`emulate.colocated`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from dora.config import DoraConfig
from dora.emulated.setup import urls_path
from dora.errors import ServerTimeout, ServerUnavailable
from dora.instance import Capabilities, EngineClient, InstanceHandle
from dora.lifetime import PARENT_ENV

__all__ = ["emulated_instances"]

log = logging.getLogger("dora.serve")

EMULATED = Capabilities(kv_migration=True, lora_versions=False, sessions=True)
"""An emulated instance moves requests (without KV bytes, `dora.emulated.server`), holds one
full-weight version and keeps sessions."""


@contextlib.asynccontextmanager
async def emulated_instances(
    config: DoraConfig, model_dir: str, *, count: int, stats_path: Path | None = None
) -> AsyncIterator[list[object]]:
    """Start one emulated-cluster process of `count` instances; yield their `InstanceHandle`s."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    specials = [int(t) for t in tokenizer.all_special_ids]
    first = max(specials) + 1 if specials else 0
    e = config.emulate
    args = [
        *("-m", "dora.emulated", "--instances", str(count), "--preset", e.preset),
        *("--time-scale", repr(e.time_scale), "--seed", str(e.seed)),
        *("--vocab-size", str(len(tokenizer)), "--first-token", str(first)),
    ]
    for item in e.overrides:
        args += ["--override", item]
    if stats_path is not None:
        args += ["--stats", str(stats_path)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        env={**os.environ, PARENT_ENV: str(os.getpid())},  # it dies with this serve
    )
    assert proc.stdout is not None
    handles: list[InstanceHandle] = []
    timeout_s = config.serve.weight_load_timeout_s

    async def stop_one() -> None:
        """Instances share the process: one is stopped with all of them, at exit."""

    try:
        for i in range(count):
            try:
                async with asyncio.timeout(timeout_s):
                    line = (await proc.stdout.readline()).decode().strip()
            except TimeoutError:
                raise ServerTimeout(
                    f"the emulated cluster (pid {proc.pid}) did not print instance {i}'s URL "
                    f"within {timeout_s:g} s"
                ) from None
            if not line.startswith("http"):
                raise ServerUnavailable(
                    f"the emulated cluster (pid {proc.pid}) exited ({proc.returncode}) after "
                    f"{i} of {count} instances"
                )
            client = EngineClient(
                line,
                timeout_s=config.serve.request_timeout_s,
                control_timeout_s=config.serve.weight_load_timeout_s,
                capabilities=EMULATED,
            )
            handles.append(InstanceHandle(id=f"i{i}", url=line, client=client, stop=stop_one))
        log.info("emulated cluster (pid %d): %d instances", proc.pid, count)
        if stats_path is not None:  # where a colocated emulated trainer finds the instances
            urls_path(stats_path.parent).write_text("".join(h.url + "\n" for h in handles))
        yield list(handles)
    finally:
        for h in handles:
            await h.client.close()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                async with asyncio.timeout(10.0):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
