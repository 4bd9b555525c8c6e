"""Environment errors under both group policies: `mask` keeps the group whole with masked samples;
`retry` regenerates the whole group at its version, then masks once retries run out (C2 either
way: every step still gets exactly B whole groups)."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
from serve_helpers import on_free_port, serve_in_process
from serve_trainer import ToyTrainer

from dora.config import DoraConfig, load_config
from dora.env import Episode, Task
from dora.errors import EnvError
from envs.math import ChainArithmeticEnv, chain_arithmetic_tasks

pytestmark = pytest.mark.timeout(120)

STEPS, B, G = 4, 2, 2
_calls = itertools.count()


class FlakyEnv(ChainArithmeticEnv):
    """Every third reward raises (a scorer that crashes now and then)."""

    def reward(self, episode: Episode) -> float:
        if next(_calls) % 3 == 2:
            raise RuntimeError("scorer crashed")
        return 0.0


class BrokenEnv(ChainArithmeticEnv):
    """Every reset raises but one task's (a source without a single usable row stops at start
    instead, naming the source): the episodes of the first steps cannot run."""

    def reset(self, task: Task) -> list[dict[str, str]]:
        if task.prompt_id == "chain-0-49":
            return super().reset(task)
        raise KeyError("no such task")


def short_tasks(seed: int) -> list[Task]:
    return chain_arithmetic_tasks(50, seed=seed, max_terms=6)


def _config(tmp_path: Path, model: Path, *overrides: str) -> DoraConfig:
    return load_config(
        None,
        [
            f"model.path={json.dumps(str(model))}",
            "model.max_model_len=256",
            "serve.instances=2",
            "serve.max_running=8",
            f"rollout.group_size={G}",
            f"rollout.batch_size={B}",
            "rollout.max_tokens=16",
            "rollout.max_turns=1",
            f"learn.steps={STEPS}",
            "data.source=test_serve_env_errors:short_tasks",
            "data.kwargs={}",
            f"log.run_dir={json.dumps(str(tmp_path))}",
            "log.metrics_every_s=0.2",
            "log.progress=false",
            *overrides,
        ],
    )


@pytest.mark.parametrize("policy", ["mask", "retry"])
async def test_env_errors(tmp_path: Path, long_tail_model: Path, policy: str) -> None:
    config = _config(
        tmp_path,
        long_tail_model,
        f"rollout.on_env_error={policy}",
        "rollout.max_retries=1",
        "env.cls=test_serve_env_errors:FlakyEnv",
    )
    config, address = on_free_port(config)
    trainer = ToyTrainer(address, model_dir=long_tail_model, steps=STEPS, batch_size=B)
    trainer.start()
    await asyncio.wait_for(serve_in_process(config, run_dir=tmp_path), 90)
    await asyncio.to_thread(trainer.join)
    assert all(len(trainer.by_step[s]) == B for s in range(STEPS))
    samples = [s for _, g in trainer.received for s in g.samples]
    assert all(len(g.samples) == G for _, g in trainer.received), "groups stay whole"
    masked = [s for s in samples if s.masked]
    assert all("scorer crashed" in s.metadata["error"] for s in masked)
    ticks = [json.loads(x) for x in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    last = [t for t in ticks if t["kind"] == "tick"][-1]
    if policy == "mask":
        assert masked and last["retried"] == 0
    else:
        assert last["retried"] > 0, "failed groups were regenerated"
        # a group is sent with masked samples only once its retry failed too
        with_masked = {g.id for _, g in trainer.received if any(s.masked for s in g.samples)}
        assert last["masked"] == len(with_masked)
    if policy == "mask":  # the summary counts masked samples, by what failed
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["extra"]["masked_samples"] == len(masked) > 0
        assert summary["masked_reasons"] == {"reward raised RuntimeError": len(masked)}


async def test_a_step_whose_every_sample_is_masked_stops_the_run(
    tmp_path: Path, long_tail_model: Path
) -> None:
    config = _config(tmp_path, long_tail_model, "env.cls=test_serve_env_errors:BrokenEnv")
    config, address = on_free_port(config)
    trainer = ToyTrainer(address, model_dir=long_tail_model, steps=STEPS, batch_size=B)
    trainer.start()
    with pytest.raises(ExceptionGroup) as info:
        await asyncio.wait_for(serve_in_process(config, run_dir=tmp_path), 90)
    await asyncio.to_thread(trainer.stop)  # serve is gone: the trainer would wait out its timeout
    [error] = info.value.exceptions
    assert isinstance(error, EnvError), error
    message = str(error)
    assert f"every one of the {B * G} samples of step 0 was masked" in message, message
    assert "'reset raised KeyError'" in message and "BrokenEnv" in message, message
    records = [json.loads(x) for x in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    [summary] = [r for r in records if r["kind"] == "summary"]  # written however the run ends
    assert summary["extra"]["masked_samples"] >= B * G
