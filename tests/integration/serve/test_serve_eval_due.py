"""Evaluation on busy instances, end to end with the toy trainer: every due evaluation runs while
groups keep both instances busy, takes its share of an instance (as many episodes at once as the
first one), and says which version it evaluated and when that version was trained; the run ends
(final evaluation included) soon after the last step is durable."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from serve_helpers import on_free_port, serve_in_process
from serve_trainer import ToyTrainer

from dora.config import load_config
from dora.env import Task
from envs.math import chain_arithmetic_tasks

pytestmark = pytest.mark.timeout(120)

STEPS, B, G, EVERY, EVAL_SIZE, MAX_RUNNING = 16, 2, 4, 4, 16, 8


def train_tasks() -> list[Task]:
    return chain_arithmetic_tasks(100, seed=3, max_terms=6)


def held_out() -> list[Task]:
    return chain_arithmetic_tasks(EVAL_SIZE, seed=1003, max_terms=6)


async def _run(
    tmp_path: Path, model: Path, overrides: list[str], *, steps: int, step_time_s: float
) -> list[dict[str, object]]:
    """Serve a run of `steps` steps to the toy trainer; the run's records."""
    config = load_config(
        None,
        [
            f"model.path={json.dumps(str(model))}",
            "model.max_model_len=256",
            "serve.instances=2",
            f"rollout.group_size={G}",
            f"rollout.batch_size={B}",
            "rollout.max_tokens=24",
            "rollout.max_turns=1",
            f"learn.steps={steps}",
            "data.source=test_serve_eval_due:train_tasks",
            "data.eval_source=test_serve_eval_due:held_out",
            f"log.run_dir={json.dumps(str(tmp_path))}",
            "log.metrics_every_s=0.25",
            "log.progress=false",
            *overrides,
        ],
    )
    config, address = on_free_port(config)
    trainer = ToyTrainer(
        address, model_dir=model, steps=steps, batch_size=B, step_time_s=step_time_s
    )
    trainer.start()
    await asyncio.wait_for(serve_in_process(config, run_dir=tmp_path, progress=False), 60)
    await asyncio.to_thread(trainer.join)
    return [json.loads(x) for x in (tmp_path / "rollout.jsonl").read_text().splitlines()]


@pytest.mark.slow
async def test_every_due_evaluation_runs_on_busy_instances(
    tmp_path: Path, long_tail_model: Path
) -> None:
    overrides = [
        f"serve.max_running={MAX_RUNNING}",
        "rollout.staleness=2",
        f"data.eval_size={EVAL_SIZE}",
        f"data.eval_every={EVERY}",
    ]
    records = await _run(tmp_path, long_tail_model, overrides, steps=STEPS, step_time_s=0.6)
    evals = [r for r in records if r["kind"] == "eval"]
    versions = [e["version"] for e in evals]
    assert versions[0] == 0 and versions[-1] == STEPS, versions
    # every due evaluation ran: one record per threshold, on the newest version when it was due
    dues = sorted({e["due"] for e in evals[:-1]})
    assert dues == list(range(0, STEPS, EVERY)), evals
    assert all(e["version"] >= e["due"] for e in evals), evals
    # batched like the first: as many episodes at once as the first evaluation had
    assert all(e["concurrency"] == evals[0]["concurrency"] for e in evals), evals
    assert evals[0]["concurrency"] == min(EVAL_SIZE, MAX_RUNNING // 2)
    # which version, and when it was trained (the x-axis of accuracy against training time)
    trained = {r["step"]: r["time_s"] for r in records if r["kind"] == "trained"}
    for e in evals:
        at = 0.0 if e["version"] == 0 else trained[e["version"] - 1]
        assert e["version_time_s"] == pytest.approx(at, abs=0.05), e
        assert e["version_time_s"] <= e["started_s"] <= e["time_s"]


async def test_the_run_ends_when_evaluations_compete_with_groups_for_every_slot(
    tmp_path: Path, long_tail_model: Path
) -> None:
    """Each instance holds one group (serve.max_running = G) and versions come quickly: a due
    evaluation often finds no room until its version is superseded. It must evaluate a version
    that takes requests, and the run must end (the final evaluation included)."""
    steps = 24
    overrides = [
        f"serve.max_running={G}",
        "rollout.staleness=1",
        "data.eval_size=8",
        "data.eval_every=2",
    ]
    records = await _run(tmp_path, long_tail_model, overrides, steps=steps, step_time_s=0.02)
    evals = [r["version"] for r in records if r["kind"] == "eval"]
    assert evals[0] == 0 and evals[-1] == steps, evals
    assert evals == sorted(set(evals)), evals
