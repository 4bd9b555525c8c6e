"""`dora run` on an OpenEnv environment: the word game of `tests/openenv_words.py`, an OpenEnv
`Environment` served by OpenEnv's own `create_fastapi_app`, started by this test on 127.0.0.1 (in a
thread of the test process, so the test reads every session the server ran), trained for a few
steps through `envs.openenv:OpenEnvEnv` with `url` pointing at it.

The tiny model is warmed up on the tasks' `answer` ("ok") so that it ends its turns: episodes then
run one step (the word was "ok") or three (it was not), with rewards the server computes. The
check: every reward dora trained on is the sum of one training session's step rewards, session for
session, and the held-out evaluations' rewards are those of the held-out sessions."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openenv")  # the `openenv` extra; CI installs it

from openenv_words import make_app

from envs.openenv import LocalApp
from envs.openenv.env import HELD_OUT_SEED_OFFSET

ROOT = Path(__file__).resolve().parents[3]
STEPS, B, G, TASKS, EVAL_SIZE = 3, 2, 4, 16, 4

CONFIG = f"""
[model]
path = "tiny"
max_model_len = 256
warmup_steps = 60        # on the tasks' answer: the model learns to end its turns

[serve]
instances = 1

[rollout]
group_size = {G}
batch_size = {B}
max_tokens = 32
max_turns = 3

[learn]
steps = {STEPS}
checkpoint_every = {STEPS}

[env]
cls = "envs.openenv:OpenEnvEnv"

[data]
eval_source = "env"      # OpenEnvEnv.tasks("test"): seeds from HELD_OUT_SEED_OFFSET
eval_size = {EVAL_SIZE}
eval_every = {STEPS}

[log]
samples_every = 1
progress = false
"""

pytestmark = pytest.mark.timeout(420)


def turns(loss_mask: list[int]) -> int:
    """The number of model turns in a sample: its runs of sampled tokens."""
    return sum(1 for i, m in enumerate(loss_mask) if m and (i == 0 or not loss_mask[i - 1]))


def test_openenv_dora_run_trains_on_a_local_openenv_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tasks = tmp_path / "words.jsonl"
    rows = [{"id": f"w{i}", "seed": i, "answer": "ok"} for i in range(TASKS)]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    app, sessions = make_app()
    server = LocalApp(app, name="openenv-words")
    try:
        config = tmp_path / "config.toml"
        config.write_text(
            CONFIG.replace("[env]", f"[env]\nkwargs = {{ url = '{server.url}', max_sessions = 8 }}")
            .replace("[data]", f"[data]\nsource = '{tasks}'")
            .replace("[log]", f"[log]\nrun_dir = '{run_dir}'")
        )
        proc = subprocess.run(
            [sys.executable, "-m", "dora.cli", "run", str(config)],
            cwd=tmp_path,
            # envs.openenv from this checkout, whatever the working directory
            env={
                **os.environ,
                "OMP_WAIT_POLICY": "PASSIVE",
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            },
            capture_output=True,
            text=True,
            timeout=400,
            check=False,
        )
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text  # the server's
    assert json.loads((run_dir / "summary.json").read_text())["steps_trained"] == STEPS

    groups = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    samples = [s for g in groups for s in g["samples"]]
    assert len(samples) == STEPS * B * G and not any(s["masked"] for s in samples)
    played = [s for s in samples if s["reward"] > 0]  # every step earns at least STEP_REWARD
    by_turns = [sum(turns(s["loss_mask"]) == n for s in samples) for n in (1, 2, 3)]
    print(f"samples by turns 1/2/3: {by_turns}; rewards: {sorted(s['reward'] for s in samples)}")
    assert by_turns[1] + by_turns[2] > 0, "no episode went past one step"

    # Sessions that stepped: the training episodes, and the held-out ones (seeds from the offset).
    # The others were opened to measure prompts or to warm up, and ran no step.
    stepped = [s for s in sessions if s.rewards]
    assert all(s.closed for s in sessions)
    train = [s for s in stepped if s.seed is not None and s.seed < HELD_OUT_SEED_OFFSET]
    held_out = [s for s in stepped if s not in train]
    assert sorted(s["reward"] for s in played) == pytest.approx(
        sorted(sum(s.rewards) for s in train)
    )

    records = [json.loads(line) for line in (run_dir / "rollout.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) >= 2 and all(e["n"] == EVAL_SIZE for e in evals)
    assert math.isclose(
        sum(e["reward_mean"] * e["n"] for e in evals),
        sum(sum(s.rewards) for s in held_out),
        rel_tol=1e-9,
        abs_tol=1e-9,
    )
