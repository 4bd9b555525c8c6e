"""A run directory has one owner, and a resume continues the run it names or refuses.

Real `dora run`s of the math example, made tiny: a second run on a live run directory is refused
at once naming the first's pid and writes nothing, while the first finishes intact; a resume with a
setting that defines the run changed (`rollout.group_size`), with the journal or
`checkpoints/latest` gone, or without `log.run_dir` is refused and starts nothing (or, for the
trainer's checkpoint, stops at start and is not restarted).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dora.errors import RunAborted

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "math" / "config.toml"
G, B = 4, 2

TINY = [
    f"rollout.group_size={G}",
    f"rollout.batch_size={B}",
    "rollout.max_tokens=16",
    "learn.checkpoint_every=2",
    "serve.instances=1",
    "serve.max_running=16",
    "model.warmup_steps=10",
    "data.eval_source=",
    "log.progress=false",
]


def _dora_run(cwd: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dora.cli", "run", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run's directory (copy it before changing it)."""
    cwd = tmp_path_factory.mktemp("finished")
    run_dir = cwd / "run"
    proc = _dora_run(cwd, str(EXAMPLE), *TINY, "learn.steps=4", f"log.run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


@pytest.fixture
def copy_of(finished: Path, tmp_path: Path) -> Iterator[Path]:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    yield run_dir


@pytest.mark.slow
def test_run_dir_lock_a_second_run_is_refused_naming_the_pid_and_the_first_finishes_intact(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    steps = 12
    args = [str(EXAMPLE), *TINY, f"learn.steps={steps}", f"log.run_dir={run_dir}"]
    out = (tmp_path / "first.log").open("wb")
    first = subprocess.Popen(
        [sys.executable, "-m", "dora.cli", "run", *args],
        cwd=tmp_path,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        log = run_dir / "supervisor.jsonl"
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().count('"start"') == 2):
            assert time.monotonic() < deadline and first.poll() is None, "the first run started"
            time.sleep(0.1)
        config_before = (run_dir / "config.toml").read_bytes()
        started = time.monotonic()
        second = _dora_run(tmp_path, *args, timeout=120)
        refused_s = time.monotonic() - started
        assert first.poll() is None, "the first run was still live when the second was refused"
        code = first.wait(timeout=180)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        out.close()
    assert second.returncode == RunAborted.exit_code, second.stderr[-3000:]
    assert f"pid {first.pid}" in second.stderr and "dora run" in second.stderr, second.stderr
    assert refused_s < 30, "refused at once, before anything started"
    first_log = (tmp_path / "first.log").read_text(errors="replace")
    assert code == 0, first_log[-4000:]
    # the first run is intact: its config, its supervisor's records, its whole summary
    assert (run_dir / "config.toml").read_bytes() == config_before
    starts = [r for r in _records(run_dir / "supervisor.jsonl") if r["kind"] == "start"]
    assert len(starts) == 2, f"only the first run's serve and learn started: {starts}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_trained"] == steps and summary["groups_sent"] == steps * B, summary
    assert summary["extra"]["serve_restarts"] == 0, summary


def test_resume_config_a_changed_group_size_is_refused_naming_it(copy_of: Path) -> None:
    run_dir = copy_of
    config_before = (run_dir / "config.toml").read_bytes()
    records_before = (run_dir / "supervisor.jsonl").read_bytes()
    proc = _dora_run(
        run_dir.parent,
        "--resume",
        str(EXAMPLE),
        *TINY,
        "rollout.group_size=2",
        "learn.steps=6",
        f"log.run_dir={run_dir}",
    )
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert f"rollout.group_size: {G} -> 2" in proc.stderr, proc.stderr[-3000:]
    assert "learn.steps: 4 -> 6" in proc.stderr, proc.stderr[-3000:]
    assert (run_dir / "config.toml").read_bytes() == config_before
    assert (run_dir / "supervisor.jsonl").read_bytes() == records_before, "nothing started"


def test_resume_without_the_journal_is_refused_before_anything_starts(copy_of: Path) -> None:
    run_dir = copy_of
    shutil.rmtree(run_dir / "journal")
    records_before = (run_dir / "supervisor.jsonl").read_bytes()
    proc = _dora_run(
        run_dir.parent, "--resume", str(EXAMPLE), *TINY, "learn.steps=4", f"log.run_dir={run_dir}"
    )
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "journal" in proc.stderr and str(run_dir) in proc.stderr, proc.stderr[-3000:]
    assert (run_dir / "supervisor.jsonl").read_bytes() == records_before, "nothing started"


def test_resume_without_the_latest_checkpoint_stops_at_start_and_is_not_restarted(
    copy_of: Path,
) -> None:
    run_dir = copy_of
    (run_dir / "checkpoints" / "latest").unlink()
    before = len(_records(run_dir / "supervisor.jsonl"))
    proc = _dora_run(
        run_dir.parent, "--resume", str(EXAMPLE), *TINY, "learn.steps=4", f"log.run_dir={run_dir}"
    )
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "checkpoints/latest" in proc.stderr, proc.stderr[-3000:]
    records = _records(run_dir / "supervisor.jsonl")[before:]
    learn_starts = [r for r in records if r["kind"] == "start" and r["component"] == "learn"]
    assert len(learn_starts) == 1, f"learn was not restarted: {records}"


def test_resume_without_a_run_dir_is_refused_naming_the_key(tmp_path: Path) -> None:
    proc = _dora_run(tmp_path, "--resume", str(EXAMPLE), *TINY, "learn.steps=2", timeout=120)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "log.run_dir" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "runs").exists(), "no run directory was made"
