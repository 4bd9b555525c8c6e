"""Chaos from the environment's side: `dora run` on the math example, made small, with an
environment whose hooks fail as user code does (`faulty_env.FaultyEnv`: reset raises, step sleeps
synchronously, reward raises, hangs, returns NaN, a string, a list). The run must end on its own
with no instance declared dead and no side restarted, its accounting exact (admitted = consumed +
filtered + rolled back, no group twice, staleness at most K), and every failure counted by reason
in summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_chaos import EXAMPLE, check_accounting

from tests.commands import start_dora_run

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

STEPS, B, G, K = 60, 2, 4, 2
REWARD_TIMEOUT_S = 2


def test_chaos_faulty_environment(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        f"learn.steps={STEPS}",
        f"learn.checkpoint_every={STEPS}",
        f"rollout.batch_size={B}",
        f"rollout.group_size={G}",
        f"rollout.staleness={K}",
        "rollout.max_tokens=16",
        "serve.instances=2",
        "serve.max_running=16",
        "serve.health_timeout_s=5",
        "env.cls=tests.chaos.faulty_env:FaultyEnv",
        f"env.reward_timeout_s={REWARD_TIMEOUT_S}",
        "model.warmup_steps=0",  # the warm-up stops on an environment error, by design
        "data.eval_source=",
        "log.progress=false",
        "log.metrics_every_s=0.5",
        f"log.run_dir={run_dir}",
    ]
    out = tmp_path / "dora-run.log"
    run = start_dora_run(EXAMPLE, overrides, log=out, cwd=tmp_path, DORA_CHAOS_ENV_SEED="7")
    try:
        code = run.wait(timeout=270)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert code == 0, out.read_text(errors="replace")[-4000:]

    extra = check_accounting(run_dir, steps=STEPS, batch_size=B, staleness=K)
    summary = json.loads((run_dir / "summary.json").read_text())
    reasons = summary["masked_reasons"]
    print("masked by reason:", json.dumps(reasons, indent=1), "extra:", extra)
    print("max loop stall (ms):", summary["max_loop_stall_ms"])
    assert sum(reasons.values()) == extra["masked_samples"] > 0
    expected = (
        "reset raised RuntimeError",
        "reward raised ValueError",
        f"reward timed out after {REWARD_TIMEOUT_S} s",
        "reward returned a value that is not finite",
        "reward returned a str, not a number or a dict of numbers",
        "reward returned a list, not a number or a dict of numbers",
    )
    assert all(reasons.get(r, 0) > 0 for r in expected), reasons
    assert summary["instances_failed"] == [], "no instance declared dead for the env's sleeps"
    exits = [
        r
        for r in map(json.loads, (run_dir / "supervisor.jsonl").read_text().splitlines())
        if r["kind"] == "exit"
    ]
    assert exits == [], exits
