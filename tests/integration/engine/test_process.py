"""`python -m dora.engine` as a child process: prints its URL, serves, stops on SIGTERM."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from dora.engine import EngineClient
from dora.protocol import SamplingParams

pytestmark = pytest.mark.timeout(90)


async def test_process_prints_url_serves_and_stops(tiny_model: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "dora.engine", "--model", str(tiny_model), "--port", "0"),
        *("--version", "4", "--threads", "1"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    try:
        url = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
        assert url.startswith("http://127.0.0.1:")
        async with EngineClient(url) as client:
            assert (await client.health())["version"] == 4
            out = await client.generate([5, 6], SamplingParams(max_tokens=3), request_id="p")
            assert list(out.versions) == [4] * len(out.token_ids)
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
