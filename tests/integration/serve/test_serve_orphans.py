"""Engines die with the `dora serve` that started them: SIGKILLed (no clean-up of its own runs),
it leaves no engine process behind holding its cores and memory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.chaos.processes import children

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "math" / "config.toml"


def _engines(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"dora.engine" in argv:
            found.append(child)
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.slow
def test_engines_die_with_a_killed_serve(tmp_path: Path) -> None:
    log = (tmp_path / "serve.log").open("wb")
    serve = subprocess.Popen(
        [
            *(sys.executable, "-m", "dora.cli", "serve", str(EXAMPLE)),
            *("serve.instances=2", "model.warmup_steps=10", "data.eval_source="),
            *("log.progress=false", f"log.run_dir={tmp_path / 'run'}"),
        ],
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    engines: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while (tmp_path / "serve.log").read_text().count(" serves at http") < 2:
            assert time.monotonic() < deadline and serve.poll() is None, "both engines serve"
            time.sleep(0.2)
        engines = _engines(serve.pid)
        assert len(engines) == 2, engines
        serve.send_signal(signal.SIGKILL)  # serve alone, not its process group
        serve.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in engines) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in engines if _alive(pid)]
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        with contextlib.suppress(ProcessLookupError):  # what a failed run would leave
            os.killpg(serve.pid, signal.SIGKILL)
        log.close()
    assert not left, f"engines outlived their serve: {left}"
