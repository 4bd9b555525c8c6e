"""The metrics log and ticker."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from dora.config import load_config
from dora.errors import ConfigError
from dora.records import Record
from dora.serve.metrics import MetricsLog, Ticker


async def test_metrics_log_and_ticker(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    seen: list[float] = []

    class FakeTick(Record, tag="tick"):
        n: int

    def snapshot(lag_ms: float, stall_ms: float) -> FakeTick:
        seen.append(lag_ms)
        return FakeTick(n=len(seen))

    ticker = Ticker(log, snapshot, every_s=0.01)  # type: ignore[arg-type]
    task = asyncio.ensure_future(ticker.run())
    await asyncio.sleep(0.08)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    class FakeSummary(Record, tag="summary"):
        ok: bool

    log.write(FakeSummary(ok=True))
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    assert len(lines) >= 3 and lines[0]["kind"] == "tick" and lines[0]["n"] == 1
    assert lines[-1] == {"kind": "summary", "time_s": lines[-1]["time_s"], "ok": True}
    assert all(lag >= 0 for lag in seen)


async def test_a_pause_between_ticks_shows_as_the_next_ticks_stall(tmp_path: Path) -> None:
    """The tick's own lag misses a pause that ends before the tick falls due; the stall probe
    sees it, in the next tick."""
    log = MetricsLog(tmp_path)
    seen: list[tuple[float, float]] = []
    ticked = asyncio.Event()

    class FakeTick(Record, tag="tick"):
        n: int

    def snapshot(lag_ms: float, stall_ms: float) -> FakeTick:
        seen.append((lag_ms, stall_ms))
        ticked.set()
        return FakeTick(n=len(seen))

    ticker = Ticker(log, snapshot, every_s=0.5)  # type: ignore[arg-type]
    task = asyncio.ensure_future(ticker.run())
    await asyncio.sleep(0.05)
    time.sleep(0.15)  # noqa: ASYNC251 - the whole loop stops, well before the tick is due
    await ticked.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    log.close()
    lag_ms, stall_ms = seen[0]
    assert stall_ms >= 100.0 and ticker.max_stall_ms >= 100.0
    assert lag_ms < stall_ms


def test_a_group_must_fit_one_instance() -> None:
    # checked when the config is loaded (before dora serve starts anything)
    with pytest.raises(ConfigError, match=r"group_size = 16 .* serve.max_running = 8"):
        load_config(None, ["rollout.group_size=16", "serve.max_running=8"])


def test_sample_log_shows_which_version_sampled_which_tokens(tmp_path: Path) -> None:
    from dora.protocol import Group, Sample
    from dora.serve.metrics import SampleLog

    # a trajectory resumed under version 3 after 2 tokens of version 2
    sample = Sample.build(
        token_ids=[7, 8, 9, 10, 11],
        loss_mask=[0, 1, 1, 1, 1],
        logprobs=[0.0, -0.1, -0.2, -0.3, -0.4],
        versions=[-1, 2, 2, 3, 3],
        prompt_len=1,
        reward=1.0,
    )
    log = SampleLog(tmp_path, every=1, decode=lambda ids: " ".join(map(str, ids)))
    log.write(Group(id="g", prompt_id="p", version=2, samples=[sample]))
    (line,) = (tmp_path / "samples.jsonl").read_text().splitlines()
    (written,) = json.loads(line)["samples"]
    assert written["version_spans"] == [[1, 3, 2], [3, 5, 3]]
