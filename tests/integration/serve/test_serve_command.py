"""`dora serve` as a user runs it: a process that starts engine processes, serves a trainer over
ZMQ until the last step, writes its metrics, stops its instances and exits 0; and keeps going when
one of its instances dies in the middle of the run (docs/reliability.md): the dead instance's
requests move, and a replacement process starts and loads the version it is given."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serve_trainer import ToyTrainer

from dora.launch import free_port

pytestmark = pytest.mark.timeout(240)

STEPS, B, INSTANCES = 6, 2, 3


def _engine_children(parent: int) -> list[int]:
    """Engine processes started by process `parent` (dora serve's instance pool)."""
    pids = []
    for path in Path(f"/proc/{parent}/task").glob("*/children"):
        for pid in path.read_text().split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"dora.engine" in cmdline:
                pids.append(int(pid))
    return sorted(pids)


def _config(
    tmp_path: Path, model: Path, port: int, *, instances: int, serve_extra: str = ""
) -> Path:
    config = tmp_path / "serve.toml"
    config.write_text(
        f"""
[model]
path = {json.dumps(str(model))}
max_model_len = 256
[serve]
instances = {instances}
max_running = 8
port = {port}
request_timeout_s = 120
{serve_extra}
[rollout]
mode = "dora"
staleness = 1
group_size = 2
batch_size = {B}
max_tokens = 32
max_turns = 1
[learn]
steps = {STEPS}
[log]
run_dir = {json.dumps(str(tmp_path / "run"))}
metrics_every_s = 0.5
progress = false
"""
    )
    return config


def _run_with_a_faulty_instance(
    tmp_path: Path, model: Path, fault: signal.Signals, *, serve_extra: str = ""
) -> tuple[str, list[int]]:
    """`dora serve` with INSTANCES engines, one of which gets `fault` after step 1 is trained
    (SIGSTOP: resumed 20 s later, if it still exists); the trainer waits at step 2 until a
    replacement started, so the run outlasts the fault. Checks that every group was trained
    once within K and C1; returns serve's stderr and the victim's pid."""
    port = free_port("127.0.0.1")
    run_dir = tmp_path / "run"
    config = _config(tmp_path, model, port, instances=INSTANCES, serve_extra=serve_extra)
    serve: list[subprocess.Popen[str]] = []
    victims: list[int] = []

    def resume(pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    def inject(step: int) -> None:
        if step == 1:
            victim = _engine_children(serve[0].pid)[0]
            os.kill(victim, fault)
            victims.append(victim)
            timer = threading.Timer(20.0, resume, args=(victim,))
            timer.daemon = True
            timer.start()
        if step == 2:
            log = run_dir / "rollout.jsonl"
            deadline = time.monotonic() + 90
            while b"instance_restarted" not in log.read_bytes() and time.monotonic() < deadline:
                time.sleep(0.2)

    trainer = ToyTrainer(
        f"tcp://127.0.0.1:{port}",
        model_dir=model,
        steps=STEPS,
        batch_size=B,
        timeout_s=180,
        on_trained=inject,
    )
    trainer.start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dora.cli", "serve", str(config), "data.seed=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    serve.append(proc)
    try:
        stdout, stderr = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in victims:
            resume(pid)
    trainer.join()
    assert proc.returncode == 0, stderr[-3000:]
    assert f"trainer link on tcp://127.0.0.1:{port}" in stdout
    assert victims, "the fault was injected"
    ids = [g.id for _, g in trainer.received]
    assert len(ids) == STEPS * B == len(set(ids)), "every group exactly once"
    assert trainer.trained == list(range(STEPS)) and trainer.shutdown
    for step, group in trainer.received:
        assert 0 <= step - group.version <= 1
        for s in group.samples:
            assert (s.token_versions()[s.mask() == 1] == group.version).all(), "C1"
    return stderr, victims


@pytest.mark.slow
def test_dora_serve_command_survives_a_dead_instance(tmp_path: Path, long_tail_model: Path) -> None:
    run_dir = tmp_path / "run"
    stderr, killed = _run_with_a_faulty_instance(tmp_path, long_tail_model, signal.SIGKILL)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["groups_sent"] == STEPS * B
    replacement = f"i{INSTANCES}"
    assert set(summary["utilisation"]) == {f"i{i}" for i in range(INSTANCES + 1)}
    assert len(summary["instances_failed"]) == 1, summary
    assert summary["extra"]["instance_restarts"] == 1, summary
    records = [json.loads(x) for x in (run_dir / "rollout.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in records}
    assert {"tick", "step", "trained", "instance_failed", "instance_restarted", "summary"} <= kinds
    loads = [r for r in records if r["kind"] == "weight_load" and r["instance"] == replacement]
    assert loads and loads[0]["version"] >= 1, "the replacement loaded a version from the store"
    pids = [int(p) for p in re.findall(r"instance i\d \(pid (\d+)\)", stderr)]
    assert len(pids) == INSTANCES + 1 and killed[0] in pids, stderr[-3000:]
    for pid in pids:  # every instance process was stopped by its handle
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_a_hung_instance_is_declared_dead_at_its_health_deadline_and_replaced(
    tmp_path: Path, long_tail_model: Path
) -> None:
    """SIGSTOP one engine: it answers nothing but is not gone. Past `serve.health_timeout_s` it is
    dead like a killed one: its calls are cut and resubmitted to the other instances, it is
    killed and replaced, and the run finishes without waiting for `serve.request_timeout_s`."""
    run_dir = tmp_path / "run"
    stderr, stopped = _run_with_a_faulty_instance(
        tmp_path, long_tail_model, signal.SIGSTOP, serve_extra="health_timeout_s = 2"
    )
    records = [json.loads(x) for x in (run_dir / "rollout.jsonl").read_text().splitlines()]
    hung = [r for r in records if r["kind"] == "instance_unresponsive"]
    assert len(hung) == 1 and "within 2 s" in hung[0]["error"], (hung, stderr[-3000:])
    failed = [r["instance"] for r in records if r["kind"] == "instance_failed"]
    assert failed == [hung[0]["instance"]], failed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["extra"]["instance_restarts"] == 1, summary
    with pytest.raises(ProcessLookupError):  # serve killed the hung process
        os.kill(stopped[0], 0)


def test_dora_serve_stops_with_a_clear_error_when_no_instance_is_left(
    tmp_path: Path, long_tail_model: Path
) -> None:
    """One instance, no replacements allowed: its death ends the run with an error that names the
    limit (instead of waiting for an instance that will never come)."""
    port = free_port("127.0.0.1")
    config = _config(
        tmp_path, long_tail_model, port, instances=1, serve_extra="max_instance_restarts = 0"
    )
    serve: list[subprocess.Popen[str]] = []

    def kill_the_instance(step: int) -> None:
        if step == 1:
            os.kill(_engine_children(serve[0].pid)[0], signal.SIGKILL)

    trainer = ToyTrainer(
        f"tcp://127.0.0.1:{port}",
        model_dir=long_tail_model,
        steps=STEPS,
        batch_size=B,
        timeout_s=60,  # serve is gone without a word: the trainer gives up after this (and
        # waits this long for serve to start its instance: over 20 s on a loaded machine)
        on_trained=kill_the_instance,
    )
    trainer.start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dora.cli", "serve", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    serve.append(proc)
    try:
        _, stderr = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    trainer.stop()  # serve is gone: nothing more will come
    assert proc.returncode != 0
    assert "every inference instance is gone" in stderr, stderr[-3000:]
    assert "0 of serve.max_instance_restarts = 0" in stderr, stderr[-3000:]
