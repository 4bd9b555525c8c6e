"""`dora serve` as a user runs it: a process that starts engine processes, serves a trainer over
ZMQ until the last step, writes its metrics, stops its instances and exits 0."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from serve_trainer import ToyTrainer

pytestmark = pytest.mark.timeout(240)

STEPS, B = 3, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_dora_serve_command(tmp_path: Path, long_tail_model: Path) -> None:
    port = _free_port()
    run_dir = tmp_path / "run"
    config = tmp_path / "serve.toml"
    config.write_text(
        f"""
[model]
path = {json.dumps(str(long_tail_model))}
max_model_len = 256
[serve]
instances = 2
max_running = 8
port = {port}
request_timeout_s = 120
[rollout]
mode = "dora"
staleness = 1
group_size = 2
batch_size = {B}
max_tokens = 24
max_turns = 1
[learn]
steps = {STEPS}
[log]
run_dir = {json.dumps(str(run_dir))}
metrics_every_s = 0.5
progress = false
"""
    )
    trainer = ToyTrainer(
        f"tcp://127.0.0.1:{port}", model_dir=long_tail_model, steps=STEPS, batch_size=B
    )
    trainer.timeout_s = 180
    trainer.start()
    proc = subprocess.run(
        [sys.executable, "-m", "dora.cli", "serve", str(config), "data.seed=1"],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    trainer.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"trainer link on tcp://127.0.0.1:{port}" in proc.stdout
    assert sorted(trainer.by_step) == list(range(STEPS)) and trainer.shutdown
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["groups_sent"] == STEPS * B
    assert set(summary["utilisation"]) == {"i0", "i1"}
    assert (run_dir / "rollout.jsonl").stat().st_size > 0
    pids = [int(p) for p in re.findall(r"instance i\d \(pid (\d+)\)", proc.stderr)]
    assert len(pids) == 2, proc.stderr[-3000:]
    for pid in pids:  # every instance process was stopped by its handle
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
