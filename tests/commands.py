"""`dora` commands as tests start them: `python -m dora.cli` of the checkout under test, with the
checkout first on `PYTHONPATH`, so that the command and the modules it imports by name (`envs.*`,
`tests.chaos.faulty_env`) come from this tree whatever the working directory, as they do in CI
from a plain checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DORA = [sys.executable, "-m", "dora.cli"]


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on `PYTHONPATH`, plus `extra`."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_dora(
    *args: str, cwd: Path, timeout_s: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """`dora ARGS` to the end in `cwd`, its output captured; prepared models are cached in
    `cwd/cache`, so that nothing lands outside the test's folder; `env` is added to the
    environment."""
    return subprocess.run(
        [*DORA, *args],
        cwd=cwd,
        env=checkout_env(DORA_CACHE=str(cwd / "cache"), **env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def start_dora_run(
    config: Path, overrides: list[str], *, log: Path, cwd: Path, **env: str
) -> subprocess.Popen[bytes]:
    """`dora run CONFIG OVERRIDES` started in `cwd`, in a session of its own (a test can stop it
    and everything it started as a group), its output and errors written to `log`; `env` is
    added to the environment. The caller stops it by its handle."""
    with log.open("wb") as out:  # the child keeps its own copy of the file
        return subprocess.Popen(
            [*DORA, "run", str(config), *overrides],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
            env=checkout_env(**env),
        )


def jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file of a run directory, in file order."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def reward_thirds(run_dir: Path, steps: int, *, margin: float) -> tuple[float, float]:
    """The trainer's mean reward over the first and the last third of a run of `steps` steps,
    from its `learn-metrics.jsonl`, after checking that every step from 0 to `steps - 1` trained
    exactly once and that the last third's is above the first's by `margin`. A failure shows
    every step's reward and staleness, so a run that did not learn can be told from one that
    learned little."""
    metrics = sorted(jsonl(run_dir / "learn-metrics.jsonl"), key=lambda m: m["step"])
    assert [m["step"] for m in metrics] == list(range(steps)), metrics
    rewards = [m["reward_mean"] for m in metrics]
    third = steps // 3
    first, last = sum(rewards[:third]) / third, sum(rewards[-third:]) / third
    steps_seen = [(round(m["reward_mean"], 3), m.get("staleness_max")) for m in metrics]
    assert last > first + margin, f"first third {first:.4f}, last {last:.4f}: {steps_seen}"
    return first, last


def held_out_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The held-out evaluations of a run (`kind` "eval" in its `rollout.jsonl`), in order."""
    return [r for r in jsonl(run_dir / "rollout.jsonl") if r["kind"] == "eval"]
