"""`dora bench converge`: the runs it plans, the curves it reads from run directories, and the
table and plot it makes of them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dora.bench import converge
from dora.bench.converge import (
    default_target,
    gain_seconds,
    plan,
    plot,
    read_run,
    table,
    target_seconds,
)
from dora.records import Trained
from tests.unit.bench.fixtures import eval_record

pytestmark = pytest.mark.timeout(60)

SEED0: dict[str, Any] = {"mode": "dora", "staleness": 1, "seed": 0}


def write_curve(
    run_dir: Path, accuracy: list[float], *, step_s: float, ess: float, off_first: float = 0.0
) -> Path:
    """Steps 0..n-2 trained every `step_s` seconds with 100 tokens each; version v evaluated at
    `accuracy[v]` (v = 0 is the warm-up)."""
    run_dir.mkdir(parents=True)
    records: list[object] = []
    for v, acc in enumerate(accuracy):
        if v:
            metrics = {"tokens": 100.0, "is_ess": ess, "off_first_version_fraction": off_first}
            records.append(Trained(time_s=v * step_s, step=v - 1, metrics=metrics))
        records.append(eval_record(v * step_s + 0.1, step=v, accuracy=acc))
    (run_dir / "rollout.jsonl").write_bytes(b"\n".join(msgspec.json.encode(r) for r in records))
    return run_dir


def test_a_run_reads_as_its_curve_throughput_and_diagnostics(tmp_path: Path) -> None:
    d = write_curve(tmp_path / "r", [0.2, 0.3, 0.5], step_s=2.0, ess=0.9, off_first=0.25)
    run = read_run(d, mode="inflight", staleness=3, seed=1)
    # version w is placed where step w - 1 was trained: versions 1 and 2 at 2 s and 4 s
    assert run.curve == [(0, 0.0, 0.2), (1, 2.0, 0.3), (2, 4.0, 0.5)]
    assert (run.steps, run.seconds, run.tokens) == (2, 4.0, 200.0)
    assert (run.steps_per_s, run.tokens_per_s, run.final_accuracy) == (0.5, 50.0, 0.5)
    assert run.diagnostics == {"is_ess": 0.9, "off_first_version_fraction": 0.25}
    assert target_seconds(run, 0.3) == 2.0
    assert target_seconds(run, 0.6) is None


def test_the_tables_time_the_target_and_sync_stands_in_every_k(tmp_path: Path) -> None:
    runs = [
        read_run(write_curve(tmp_path / "s", [0.2, 0.25, 0.3], step_s=4.0, ess=1.0), **kw)
        for kw in [{"mode": "sync", "staleness": 0, "seed": 0}]
    ]
    for k, step_s in ((1, 2.0), (3, 1.0)):
        for seed, final in ((0, 0.6), (1, 0.4)):
            d = write_curve(tmp_path / f"d{k}{seed}", [0.2, 0.4, final], step_s=step_s, ess=0.8)
            runs.append(read_run(d, mode="dora", staleness=k, seed=seed))
    target = default_target(runs)
    # halfway from the warm-up (0.2) to the best mode's mean final accuracy (dora: 0.5)
    assert target == pytest.approx(0.35)
    lines = table(runs, staleness=3, target=target)
    assert lines[0].startswith("K = 3, target accuracy 0.350")
    sync = next(line for line in lines if line.startswith("sync (1 seeds)"))
    dora = next(line for line in lines if line.startswith("dora (2 seeds)"))
    # warm-up 0.2, ended at 0.3, never at 0.35 (no time), 0.05 above its warm-up at version 1
    assert sync.split()[5:9] == ["0.200", "0.300", "-", "4"]
    assert "1 (1-1)" in dora  # both dora seeds reached it at their second version, 1 s
    assert "0.500 (0.400-0.600)" in dora
    assert all("K = 1" not in line for line in lines)
    assert any(line.startswith("sync (1 seeds)") for line in table(runs, staleness=1, target=0.3))
    plot(runs, [1, 3], tmp_path / "c.png", title="math")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_gain_is_timed_from_each_runs_own_warm_up(tmp_path: Path) -> None:
    low = read_run(write_curve(tmp_path / "a", [0.2, 0.22, 0.3], step_s=2.0, ess=1.0), **SEED0)
    high = read_run(write_curve(tmp_path / "b", [0.5, 0.5, 0.52], step_s=2.0, ess=1.0), **SEED0)
    assert (gain_seconds(low, 0.05), gain_seconds(high, 0.05)) == (4.0, None)
    assert target_seconds(high, 0.3) == 0.0  # an absolute target: met before any training


def test_sync_runs_once_per_seed_and_the_others_once_per_k() -> None:
    runs = plan(["sync", "dora", "inflight"], [1, 3], 2)
    assert runs[:5] == [
        ("sync", 0, 0),
        ("dora", 1, 0),
        ("dora", 3, 0),
        ("inflight", 1, 0),
        ("inflight", 3, 0),
    ]
    assert len(runs) == 10 and runs[5] == ("sync", 0, 1)


def test_no_evaluation_gives_no_target() -> None:
    assert math.isnan(default_target([]))


def test_a_sweep_run_again_reuses_finished_runs_and_reruns_one_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "sweep"
    config = str(Path(__file__).resolve().parents[3] / "examples/math/config.toml")
    seeds = ["model.seed=0", "learn.seed=0", "data.seed=0"]

    def command(*mode: str) -> list[str]:
        return [config, "learn.steps=2", *mode, *seeds]

    finished = write_curve(out / "sync-k0-s0", [0.2, 0.3, 0.4], step_s=1.0, ess=1.0)
    (finished / converge.DONE_FILE).write_text(json.dumps(command("rollout.mode=sync")))
    write_curve(out / "dora-k1-s0", [0.2, 0.3], step_s=1.0, ess=1.0)  # cut short: no mark
    other = write_curve(out / "dora-k3-s0", [0.2, 0.3, 0.4], step_s=1.0, ess=1.0)
    (other / converge.DONE_FILE).write_text(json.dumps([config, "learn.steps=9"]))
    ran: list[str] = []

    def fake_run(config: str, overrides: list[str], run_dir: Path, log: Path) -> int:
        assert not run_dir.exists()  # it starts again from an empty folder
        ran.append(run_dir.name)
        write_curve(run_dir, [0.2, 0.35, 0.5], step_s=0.5, ess=1.0)
        return 0

    monkeypatch.setattr(converge, "dora_run", fake_run)
    argv = [config, "--modes", "sync,dora", "--staleness", "1,3", "--seeds", "1", "--steps", "2"]
    assert converge.main([*argv, "--out", str(out)]) == 0
    assert ran == ["dora-k1-s0", "dora-k3-s0"]  # the run of other settings too
    assert converge.finished(
        out / "dora-k1-s0", command("rollout.mode=dora", "rollout.staleness=1")
    )
    doc = json.loads((out / "converge.json").read_text())
    finals = [(r["mode"], r["staleness"], r["curve"][-1][2]) for r in doc["runs"]]
    assert finals == [("sync", 0, 0.4), ("dora", 1, 0.5), ("dora", 3, 0.5)]
