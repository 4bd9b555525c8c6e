"""A new user's first run, end to end through `dora run`: an existing Hugging Face base model
folder (a tiny Llama whose tokenizer's post-processor adds `<s>`, with no chat template), a
single-turn plain-text environment with only `reset` and `reward`, and held-out evaluation every
few steps. Asserted: the run exits 0, every prompt the model was given is exactly
`tokenizer(prompt)`'s ids (`<s>` included), every due evaluation has a record, and the run ends
within 30 s of its last trained step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dora.models.tiny import TinyModelSpec, build_tiny_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))

from base_task import prompt_of, sum_tasks  # noqa: E402

pytestmark = pytest.mark.timeout(240)

STEPS, EVERY = 30, 5


def _run(
    tmp_path: Path, *overrides: str, returncode: int = 0
) -> tuple[Path, Path, float, subprocess.CompletedProcess[str]]:
    """`dora run` on the base model and `base_task`; (the model folder, the run directory, when
    the command returned, the command)."""
    model = build_tiny_model(
        tmp_path / "base-llama",
        TinyModelSpec(hidden_size=64, num_layers=1, intermediate_size=128),
        base=True,
    )
    run_dir = tmp_path / "run"
    config = tmp_path / "config.toml"
    config.write_text(
        f"""
[model]
path = {json.dumps(str(model))}
max_model_len = 64
[serve]
instances = 1
max_running = 16
[rollout]
staleness = 1
group_size = 4
batch_size = 2
max_tokens = 6
max_turns = 1
[learn]
steps = {STEPS}
checkpoint_every = 10
lr = 1e-3
[env]
cls = "base_task:SumEnv"
[data]
source = "base_task:sum_tasks"
eval_source = "base_task:sum_tasks"
eval_kwargs = {{ n = 8, seed = 1 }}
eval_size = 8
eval_every = {EVERY}
[log]
run_dir = {json.dumps(str(run_dir))}
progress = false
samples_every = 1
"""
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "dora.cli", "run", str(config), *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    ended = time.time()
    assert proc.returncode == returncode, proc.stderr[-4000:]
    return model, run_dir, ended, proc


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_base_model_with_plain_text_prompts_trains_evaluates_and_ends(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model, run_dir, ended, proc = _run(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(model)

    # piped, not a terminal: a line per step with what a user watches, and a table at the end
    lines = re.findall(
        r"step (\d+)/(\d+)  v(\d+)  reward \S+  loss \S+  tokens/s \S+  "
        r"staleness \S+ \(max \d+\)  trainer wait \S+ s.*",
        proc.stderr,
    )
    assert [(int(a), int(b)) for a, b, _ in lines] == [(k, STEPS) for k in range(1, STEPS + 1)], (
        proc.stderr[-3000:]
    )
    assert "held-out reward" in proc.stderr
    assert re.search(rf"steps trained +{STEPS} of {STEPS}", proc.stdout), proc.stdout
    assert re.search(r"groups +\d+ admitted = \d+ trained \+", proc.stdout), proc.stdout
    assert tokenizer.chat_template is None

    # every prompt is tokenizer(prompt), special tokens included
    tasks = {t.prompt_id: t for t in sum_tasks()}
    groups = _records(run_dir / "samples.jsonl")
    assert len(groups) >= 2 * STEPS
    for g in groups:
        expected = tokenizer(prompt_of(tasks[g["prompt_id"]])).input_ids
        assert expected[0] == tokenizer.bos_token_id
        for s in g["samples"]:
            assert s["token_ids"][: s["prompt_len"]] == expected, g
            assert not s["masked"] and s["finish_reason"] in ("stop", "length"), s

    # every due evaluation has a record, and the final version is evaluated
    evals = [r for r in _records(run_dir / "rollout.jsonl") if r["kind"] == "eval"]
    assert sorted({e["due"] for e in evals[:-1]}) == list(range(0, STEPS, EVERY)), evals
    assert evals[-1]["version"] == STEPS and all(e["n"] == 8 for e in evals), evals

    # the run ends within seconds of its last durable step
    steps = _records(run_dir / "learn-metrics.jsonl")
    assert sorted(s["step"] for s in steps) == list(range(STEPS))
    last_step = max(s["time"] for s in steps)
    print(f"run ended {ended - last_step:.1f} s after its last step")
    assert ended - last_step < 30, ended - last_step


@pytest.mark.slow
def test_a_time_budget_ends_the_run_at_a_step_checkpointed_and_evaluated(tmp_path: Path) -> None:
    from dora.learn.checkpoint import latest_checkpoint

    budget_s = 8.0
    _, run_dir, ended, _ = _run(
        tmp_path,
        "learn.steps=100000",
        f"learn.max_minutes={budget_s / 60}",
        "data.eval_every=0",
        "data.eval_every_s=2",
    )
    steps = sorted(s["step"] for s in _records(run_dir / "learn-metrics.jsonl"))
    last = steps[-1]
    assert steps == list(range(last + 1)) and 0 < last < 100000
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None and checkpoint.step == last, "the last step is durable"
    records = _records(run_dir / "rollout.jsonl")
    [budget] = [r for r in records if r["kind"] == "budget"]
    assert budget["last_step"] == last and budget["time_s"] >= budget_s
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[0]["version"] == 0 and evals[-1]["version"] == last + 1, evals
    # by time: each due (every 2 s of the run) evaluated a version trained at or after it
    timed = [e for e in evals if e["due_s"] is not None]
    dues = [e["due_s"] for e in timed]
    assert len(dues) >= 2 and dues == sorted(set(dues)) and all(d % 2 == 0 for d in dues), evals
    assert all(e["version_time_s"] >= e["due_s"] for e in timed), evals
    trained_at = max(s["time"] for s in _records(run_dir / "learn-metrics.jsonl"))
    assert ended - trained_at < 30


def test_a_chat_env_on_a_model_without_a_chat_template_stops_once_at_start(tmp_path: Path) -> None:
    model, run_dir, _, proc = _run(tmp_path, "env.cls=base_task:ChatSumEnv", returncode=1)
    assert "has no chat template" in proc.stderr and str(model) in proc.stderr, proc.stderr[-3000:]
    assert "serve failed while starting" in proc.stderr
    starts = [r for r in _records(run_dir / "supervisor.jsonl") if r["kind"] == "start"]
    assert [r["component"] for r in starts].count("serve") == 1, "not restarted"
