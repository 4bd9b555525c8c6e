"""examples/guess, the tutorial of docs/environments.md saved as files, run as its README says:
`dora run config.toml` from that folder warms the tiny model up on the game's demonstrations,
trains on the game to the end and evaluates held-out games (the warmed-up model wins most), and
`python play.py MODEL_DIR` plays four games by hand. The config is used as written; only the run
directory is moved into the test's temporary folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "guess"

pytestmark = pytest.mark.timeout(600)


def run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=EXAMPLE,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
        capture_output=True,
        text=True,
        timeout=560,
        check=False,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.slow
def test_guess_example_runs_to_the_end_with_held_out_evaluations(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run([sys.executable, "-m", "dora.cli", "run", "config.toml", f"log.run_dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_trained"] == 4
    records = [json.loads(line) for line in (run_dir / "rollout.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[0]["version"] == 0 and evals[-1]["version"] == 4
    # The warm-up taught the model built from scratch to play: binary search wins 7 secrets in 10
    # (a model that had not learned the game cannot write a tool call, and wins none).
    assert evals[0]["accuracy"] >= 0.5, evals[0]
    for e in evals:
        assert e["n"] == 16 and 0.0 <= e["accuracy"] <= 1.0
        # accuracy is the share of games won (reward >= 1.0); a win scores at most 1.12
        assert e["accuracy"] <= e["reward_mean"] <= 1.12 * e["accuracy"] + 1e-9


def test_guess_example_plays_by_hand(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    made = run([sys.executable, "-m", "dora.cli", "init-model", "tiny", str(model)])
    assert made.returncode == 0, made.stderr[-4000:]
    played = run([sys.executable, "play.py", str(model)])
    assert played.returncode == 0, played.stderr[-4000:]
    lines = played.stdout.splitlines()
    assert len(lines) == 4, played.stdout
    for line in lines:
        reward, rest = line.split(" ", 1)
        assert 0.0 <= float(reward) <= 1.12 and "'solved'" in rest
