"""What an environment's hooks and data can do to `dora serve`: nothing that stalls it or stops
the run. A synchronous reward that sleeps runs off the event loop (no instance misses its health
deadline), a reward that never returns is cut at `env.reward_timeout_s`, and a prompt the tokenizer
refuses (a lone surrogate) masks its episode, named, instead of killing serve."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path

import pytest
from serve_helpers import on_free_port, serve_in_process
from serve_trainer import ToyTrainer
from test_serve_env_errors import STEPS, B, G, _config

from dora.config import DoraConfig
from dora.env import Episode, Task
from dora.looplag import p99
from envs.math import ChainArithmeticEnv

pytestmark = pytest.mark.timeout(150)

_calls = itertools.count()


class SleepyRewardEnv(ChainArithmeticEnv):
    """A synchronous scorer that blocks: its first call for longer than the health deadline."""

    def reward(self, episode: Episode) -> float:  # type: ignore[override]
        n = next(_calls)
        if n == 0:
            time.sleep(6.0)
        elif n % 10 == 5:
            time.sleep(0.5)
        return 0.0


class HangingRewardEnv(ChainArithmeticEnv):
    """An async scorer that never returns for one episode in five."""

    async def reward(self, episode: Episode) -> float:  # type: ignore[override]
        if next(_calls) % 5 == 2:
            await asyncio.Event().wait()
        return 0.0


def _surrogate(task: Task) -> bool:
    return int(task.prompt_id.rsplit("-", 1)[1]) % 10 == 3


class SurrogatePromptEnv(ChainArithmeticEnv):
    """Plain-text prompts, one in ten carrying a lone surrogate (broken UTF-16 from a loader)."""

    chat = False

    def prompt(self, task: Task) -> str:
        text = super().prompt(task)
        return text + "\ud83d" if _surrogate(task) else text


async def _run(
    config: DoraConfig, tmp_path: Path, model: Path, *, steps: int = STEPS
) -> ToyTrainer:
    config, address = on_free_port(config)
    trainer = ToyTrainer(address, model_dir=model, steps=steps, batch_size=B)
    trainer.start()
    try:
        await asyncio.wait_for(serve_in_process(config, run_dir=tmp_path), 60)
    except BaseException:
        await asyncio.to_thread(trainer.stop)  # serve is gone: the trainer would wait it out
        raise
    await asyncio.to_thread(trainer.join)
    return trainer


def _records(tmp_path: Path, kind: str) -> list[dict[str, object]]:
    lines = (tmp_path / "rollout.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _exact_accounting(trainer: ToyTrainer, steps: int = STEPS) -> list[object]:
    """Every step got B whole groups, none twice; the samples, for the caller to inspect."""
    assert all(len(trainer.by_step[s]) == B for s in range(steps))
    ids = [g.id for _, g in trainer.received]
    assert len(ids) == len(set(ids)) == steps * B, ids
    assert all(len(g.samples) == G for _, g in trainer.received), "groups stay whole"
    return [s for _, g in trainer.received for s in g.samples]


async def test_a_sync_reward_that_sleeps_never_stalls_serve(
    tmp_path: Path, long_tail_model: Path
) -> None:
    config = _config(
        tmp_path,
        long_tail_model,
        "env.cls=test_serve_env_hooks:SleepyRewardEnv",
        "serve.health_timeout_s=5",
        "log.metrics_every_s=0.1",
    )
    trainer = await _run(config, tmp_path, long_tail_model)
    samples = _exact_accounting(trainer)
    assert not any(s.masked for s in samples)  # type: ignore[attr-defined]
    [summary] = _records(tmp_path, "summary")
    assert summary["instances_failed"] == [], "no instance declared dead for the env's sleep"
    assert not _records(tmp_path, "instance_unresponsive")
    stalls = sorted(float(t["loop_stall_ms"]) for t in _records(tmp_path, "tick"))  # type: ignore[arg-type]
    # The scorer sleeps 6 s on the loop if it runs there; a loaded machine stalls far less.
    assert float(summary["max_loop_stall_ms"]) < 3000, summary["max_loop_stall_ms"]  # type: ignore[arg-type]
    print(f"loop stall per tick: p99 {p99(stalls):.1f} ms, max {stalls[-1]:.1f} ms")


async def test_a_hanging_reward_is_cut_at_its_deadline_and_masked_by_name(
    tmp_path: Path, long_tail_model: Path
) -> None:
    config = _config(
        tmp_path,
        long_tail_model,
        "env.cls=test_serve_env_hooks:HangingRewardEnv",
        "env.reward_timeout_s=1",
    )
    trainer = await _run(config, tmp_path, long_tail_model)
    samples = _exact_accounting(trainer)
    masked = [s for s in samples if s.masked]  # type: ignore[attr-defined]
    assert masked, "one reward in five hangs"
    for s in masked:
        error = s.metadata["error"]  # type: ignore[attr-defined]
        assert error.startswith("reward timed out after 1 s"), error
        assert "HangingRewardEnv" in error and s.metadata["prompt_id"] in error, error  # type: ignore[attr-defined]
    [summary] = _records(tmp_path, "summary")
    reasons = summary["masked_reasons"]
    assert isinstance(reasons, dict)
    # every masked sample the serve sent is counted once, by the hook that failed
    assert reasons.get("reward timed out after 1 s", 0) >= len(masked), reasons
    assert sum(reasons.values()) == summary["extra"]["masked_samples"]  # type: ignore[index]


async def test_a_surrogate_in_plain_text_prompts_masks_those_episodes_by_name(
    tmp_path: Path, long_tail_model: Path
) -> None:
    config = _config(
        tmp_path,
        long_tail_model,
        "env.cls=test_serve_env_hooks:SurrogatePromptEnv",
        "data.shuffle=false",  # the tasks in order: chain-0-3 is one of the eight groups
    )
    trainer = await _run(config, tmp_path, long_tail_model)
    samples = _exact_accounting(trainer)
    assert any(s.masked for s in samples)  # type: ignore[attr-defined]
    for s in samples:
        pid = s.metadata["prompt_id"]  # type: ignore[attr-defined]
        bad = _surrogate(Task(pid))
        assert s.masked == bad, (pid, s.metadata)  # type: ignore[attr-defined]
        if bad:
            error = s.metadata["error"]  # type: ignore[attr-defined]
            assert error.startswith("encoding reset()'s prompt raised"), error
            assert "SurrogatePromptEnv" in error and pid in error, error
