"""A real `dora run` of the math example in dora mode, made tiny: every step's record carries the
off-policy diagnostics, overall and per staleness level, and no sampled token was sampled by a
version other than its trajectory's first (dora mode pins a trajectory to one version)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "math" / "config.toml"


def test_dora_mode_samples_no_token_off_its_trajectorys_first_version(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dora.cli",
            "run",
            str(EXAMPLE),
            "rollout.mode=dora",
            "rollout.staleness=2",
            "rollout.group_size=4",
            "rollout.batch_size=2",
            "rollout.max_tokens=16",
            "serve.instances=1",
            "serve.max_running=16",
            "model.warmup_steps=10",
            "learn.steps=4",
            "learn.off_policy=icepop",
            "data.eval_source=",
            "log.progress=false",
            f"log.run_dir={run_dir}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=260,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = (run_dir / "learn-metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if x.strip()]
    assert len(steps) == 4
    for m in steps:
        assert m["tokens"] > 0
        assert m["off_first_version_fraction"] == 0.0, m
        assert 0.0 < m["is_ess"] <= 1.0 + 1e-9
        assert m["is_ratio_p05"] <= m["is_ratio_p50"] <= m["is_ratio_p95"]
        assert 0.0 <= m["staleness_tokens_mean"] <= m["staleness_max"]
        levels = {k.split("/")[0] for k in m if k.startswith("staleness") and "/" in k}
        assert levels, m
        for level in levels:
            assert m[f"{level}/off_first_version_fraction"] == 0.0
            k = int(level.removeprefix("staleness"))
            assert m[f"{level}/staleness_tokens_mean"] == pytest.approx(k)  # one version each
            assert m[f"{level}/tokens"] > 0
