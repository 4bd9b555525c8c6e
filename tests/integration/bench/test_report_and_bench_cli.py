"""`dora report` and `dora bench modes` as commands, on real runs of a tiny model (2 instances)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.commands import run_dora

TINY = """
[model]
path = "tiny"
tiny_hidden_size = 32
max_model_len = 128

[serve]
instances = 2
max_running = 16

[rollout]
staleness = 2
group_size = 2
batch_size = 2
max_tokens = 12
max_turns = 1

[learn]
steps = 3
checkpoint_every = 100

[env]
cls = "envs.math:ChainArithmeticEnv"

[data]
source = "envs.math:chain_arithmetic_tasks"
kwargs = { n = 50, max_terms = 4 }
eval_source = ""

[log]
metrics_every_s = 0.25
progress = false
"""


@pytest.mark.slow
def test_dora_report_on_a_real_run(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    run_dir = tmp_path / "run"
    done = run_dora(
        "run",
        str(config),
        f"log.run_dir={run_dir}",
        "log.tensorboard=true",
        cwd=tmp_path,
        timeout_s=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # TensorBoard got serve's ticks and the trainer's steps through dora serve (dora/tracking.py)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("learn/loss")] == [0, 1, 2]
    assert events.Scalars("serve/instances/i0/util")
    out = tmp_path / "report"
    rep = run_dora("report", str(run_dir), "--out", str(out), cwd=tmp_path, timeout_s=120)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert "report.html" in rep.stdout
    page = (out / "report.html").read_text()
    assert page.count("src='data:image/png;base64,") == 4
    assert "<th>mode</th><td>&quot;dora&quot;</td>" in page  # the finished run's summary
    for name in ("reward.png", "throughput.png", "staleness.png", "timeline.png"):
        assert (out / name).stat().st_size > 1000


@pytest.mark.slow
def test_dora_bench_modes_end_to_end(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    out = tmp_path / "bench"
    done = run_dora(
        "bench",
        "modes",
        str(config),
        "--modes",
        "sync,dora",
        "--steps",
        "8",  # a steady window of several CPU samples, so that the bound is measured
        "--out",
        str(out),
        cwd=tmp_path,
        timeout_s=400,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"dora/sync throughput ratio: \d+\.\d\d", last), done.stdout
    result = json.loads((out / "bench-modes.json").read_text())
    assert [r["name"] for r in result["results"]] == ["sync", "dora"]
    assert [p["kind"] for p in result["placements"]] == ["colocated", "shared"]
    assert result["bound_tokens_per_s"] > 0
    assert re.search(r"dora: \d+ tokens/s, \d+% of the bound", done.stdout), done.stdout
    assert all(r["cpu_s"] is not None for r in result["results"])
    assert (out / "dora" / "rollout.jsonl").is_file() and (out / "sync" / "summary.json").is_file()
    # serve's engine processes ran under CPU priority by deadline ...
    summaries = {m: json.loads((out / m / "summary.json").read_text()) for m in ("sync", "dora")}
    assert "cpu_priority_switches" in summaries["dora"]["extra"], summaries["dora"]
    # ... and with one version in flight at a time, no instance ever yielded its cores
    assert summaries["sync"]["extra"]["cpu_priority_switches"] == 0, summaries["sync"]


def test_dora_bench_trainer_runs_fewer_tokens_packed(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    done = run_dora(
        "bench",
        "trainer",
        str(config),
        "--steps",
        "2",
        "--rounds",
        "1",
        cwd=tmp_path,
        timeout_s=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"padded/packed CPU per trained token: \d+\.\d\d", last), done.stdout
    rows = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r"^\s*0\s+(padded|packed under mask|packed)\s+\S+\s+(\S+)", done.stdout, re.M
        )
    }
    # the prompt runs once per group instead of once per sample (2 samples here), by segments
    # or under the mask alike
    assert set(rows) == {"padded", "packed under mask", "packed"}, done.stdout
    assert rows["packed"] == rows["packed under mask"] < rows["padded"], done.stdout
    assert re.search(r"^mask/segments CPU per trained token: \d+\.\d\d$", done.stdout, re.M)
