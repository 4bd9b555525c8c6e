"""Evaluation while training (`dora/serve/evaluate.py`), end to end with the toy trainer.

The toy trainer publishes unperturbed weights (noise 0): every version is the same model, so
greedy evaluations must all give exactly the same numbers, and the environment's reward is a hash of
the exact completion (sampling at temperature 1 would make them differ). Checked: eval
records for version 0 first and the final version last, in between every `eval_every` steps on
the newest loaded version; the trainer kept receiving steps while an evaluation ran; no eval
episode reached the trainer.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from pathlib import Path

import pytest
from serve_helpers import on_free_port, serve_in_process
from serve_trainer import ToyTrainer

from dora.config import load_config
from dora.env import Episode, Task
from dora.serve.rollout import RolloutReport
from envs.math import ChainArithmeticEnv, chain_arithmetic_tasks

pytestmark = pytest.mark.timeout(180)

STEPS, B, G, EVERY, EVAL_SIZE = 20, 2, 4, 5, 48


class HashEnv(ChainArithmeticEnv):
    """A reward that is a fixed function of the exact question and completion (a hash): 1 for a
    third of them, else (hash % 10) / 20. Any other completion scores differently."""

    def reward(self, episode: Episode) -> float:
        h = zlib.crc32(f"{episode.task['question']}|{episode.completion}".encode())
        return 1.0 if h % 3 == 0 else (h % 10) / 20


def train_tasks(seed: int) -> list[Task]:
    return chain_arithmetic_tasks(200, seed=seed, max_terms=12)


def held_out(seed: int) -> list[Task]:
    return chain_arithmetic_tasks(EVAL_SIZE, seed=seed + 1000, max_terms=12)


async def test_eval_while_training(tmp_path: Path, long_tail_model: Path) -> None:
    config = load_config(
        None,
        [
            f"model.path={json.dumps(str(long_tail_model))}",
            "model.max_model_len=512",
            "serve.instances=2",
            "serve.max_running=8",
            "serve.request_timeout_s=120",
            "rollout.mode=dora",
            "rollout.staleness=2",
            f"rollout.group_size={G}",
            f"rollout.batch_size={B}",
            "rollout.max_tokens=40",
            "rollout.max_turns=1",
            f"learn.steps={STEPS}",
            "env.cls=test_serve_eval:HashEnv",
            "data.source=test_serve_eval:train_tasks",
            "data.kwargs={}",
            "data.eval_source=test_serve_eval:held_out",
            f"data.eval_size={EVAL_SIZE}",
            f"data.eval_every={EVERY}",
            f"log.run_dir={json.dumps(str(tmp_path))}",
            "log.metrics_every_s=0.25",
            "log.progress=false",
        ],
    )
    config, address = on_free_port(config)
    trainer = ToyTrainer(address, model_dir=long_tail_model, steps=STEPS, batch_size=B, noise=0.0)
    trainer.start()
    report = await asyncio.wait_for(serve_in_process(config, run_dir=tmp_path, progress=False), 150)
    await asyncio.to_thread(trainer.join)
    assert isinstance(report, RolloutReport)
    records = [json.loads(x) for x in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]

    # versions: 0 first (after the warm-up), the final one last, every EVERY steps in between
    versions = [e["version"] for e in evals]
    assert versions[0] == 0 and versions[-1] == STEPS, versions
    assert versions == sorted(set(versions)), versions
    assert len(versions) >= 3, versions
    assert all(e["step"] == e["version"] for e in evals)
    for due, v in zip(range(EVERY, STEPS, EVERY), versions[1:-1], strict=False):
        assert v >= due, versions
    assert report.extra["eval_first_version"] == 0
    assert report.extra["eval_last_version"] == STEPS

    # greedy: the same model gives exactly the same numbers every time
    assert all(e["n"] == EVAL_SIZE and e["masked"] == 0 for e in evals), evals
    assert len({(e["accuracy"], e["reward_mean"]) for e in evals}) == 1, evals
    assert 0 < evals[0]["accuracy"] < 1, "the reward varies with the task and completion"

    # not blocking: steps were filled and trained while an evaluation ran
    progress = [r["time_s"] for r in records if r["kind"] in ("step", "trained")]
    during = [
        t for e in evals[:-1] for t in progress if e["time_s"] - e["seconds"] < t < e["time_s"]
    ]
    assert during, (evals, progress)

    # eval episodes are not groups: the trainer got exactly its B groups per step
    assert sorted(trainer.by_step) == list(range(STEPS))
    assert all(len(gs) == B for gs in trainer.by_step.values())
    assert all(not g.id.startswith("eval") for _, g in trainer.received)
