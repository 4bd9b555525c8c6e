"""Where the dispatcher's tasks come from, and the metrics log and ticker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from dora.config import load_config
from dora.errors import ConfigError, DataError
from dora.serve.dispatcher import load_tasks
from dora.serve.metrics import MetricsLog, Ticker


def test_tasks_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": "a", "question": "1+1", "gold": "2"}\n\n{"question": "2+2"}\n')
    tasks = load_tasks(load_config(None, [f"data.source={json.dumps(str(path))}"]))
    assert [t.prompt_id for t in tasks] == ["a", "rows-3"]
    assert tasks[0]["gold"] == "2"


def test_bad_rows_name_file_and_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"rows.jsonl, row 2"):
        load_tasks(load_config(None, [f"data.source={json.dumps(str(path))}"]))
    with pytest.raises(ConfigError, match="no such file"):
        load_tasks(load_config(None, ['data.source="missing.jsonl"']))


def test_tasks_from_a_function_and_the_env_default() -> None:
    config = load_config(None, ['data.source="envs.math:chain_arithmetic_tasks"'])
    with pytest.raises(ConfigError, match="no arguments"):
        load_tasks(config)  # it needs a count: a function named here may take only a seed
    tasks = load_tasks(load_config(None, ["data.seed=3"]))  # ChainArithmeticEnv's own generator
    assert len(tasks) == 4096 and tasks[0].prompt_id.startswith("chain-3-")
    with pytest.raises(ConfigError, match="no built-in task generator"):
        load_tasks(load_config(None, ['env.cls="envs.math:GSM8KEnv"']))


async def test_metrics_log_and_ticker(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    seen: list[float] = []

    def snapshot(lag_ms: float) -> dict[str, object]:
        seen.append(lag_ms)
        return {"n": len(seen)}

    ticker = Ticker(log, snapshot, every_s=0.01)
    task = asyncio.ensure_future(ticker.run())
    await asyncio.sleep(0.08)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    log.write("summary", {"ok": True})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    assert len(lines) >= 3 and lines[0]["kind"] == "tick" and lines[0]["n"] == 1
    assert lines[-1] == {"kind": "summary", "time_s": lines[-1]["time_s"], "ok": True}
    assert all(lag >= 0 for lag in seen)


async def test_a_group_must_fit_one_instance(tmp_path: Path) -> None:
    from dora.serve.main import run_serve

    config = load_config(None, ["rollout.group_size=16", "serve.max_running=8"])
    with pytest.raises(ConfigError, match=r"group_size = 16 .* serve.max_running = 8"):
        await run_serve(config, run_dir=tmp_path)
