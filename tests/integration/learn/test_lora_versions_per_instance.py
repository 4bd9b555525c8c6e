"""`dora run` with LoRA on one instance: versions are adapters, so the one instance serves
several versions at once (K = 2), loads each new one beside those still in use (no drain), and
every consumed group's tokens are of the group's own version (C1).

Versions overlap on the instance only while a new one is published before the old one's requests
end, so a step's rollout (8 samples of up to 96 tokens per group) is made longer than a LoRA
training step; with 4 samples of 32 tokens the rollout finished first in one run of three and the
instance served one version at a time. Measured with these settings: 7 of 7 runs served several
versions at once, 3 of them beside two CPU-bound processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 6


def test_one_lora_instance_serves_several_versions_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    over = [
        "model.warmup_steps=0",
        "model.lora.rank=8",
        "model.lora.alpha=16",
        "serve.instances=1",
        "rollout.staleness=2",
        "rollout.batch_size=4",
        "rollout.group_size=8",
        "rollout.max_tokens=96",
        f"learn.steps={STEPS}",
        f"learn.checkpoint_every={STEPS}",
        f"data.eval_every={STEPS}",
        "data.eval_size=8",
        "data.eval_kwargs={n = 8, seed = 1000, max_terms = 3}",
        f"log.run_dir={json.dumps(str(run_dir))}",
        "log.progress=false",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "dora.cli", "run", str(ROOT / "examples/math/config.toml"), *over],
        cwd=ROOT,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "DORA_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=550,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(x) for x in (run_dir / "rollout.jsonl").read_text().splitlines()]
    [summary] = [r for r in records if r["kind"] == "summary"]
    assert summary["instances_failed"] == [] and list(summary["utilisation"]) == ["i0"]
    assert summary["max_versions_serving"] >= 2, summary  # one instance, several versions
    assert summary["migrations"] == summary["parks"] == 0, summary
    loads = [r for r in records if r["kind"] == "weight_load"]
    versions = [r["version"] for r in loads]
    assert versions == sorted(set(versions)) and len(versions) >= 3, loads  # each adapter once
    steps = [r for r in records if r["kind"] == "step"]
    assert max(v for s in steps for v in s["staleness"]) <= 2
    learned = [json.loads(x) for x in (run_dir / "learn-metrics.jsonl").read_text().splitlines()]
    assert sorted(m["step"] for m in learned) == list(range(STEPS))
    assert all(m["tokens"] > 0 and m["off_version_tokens"] == 0 for m in learned), learned  # C1
