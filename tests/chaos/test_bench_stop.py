"""A benchmark stopped from outside (SIGTERM: `timeout`, a CI job cancelled, `kill`) stops the runs
it started: a mode's serve and learn live in sessions of their own, so nothing else would."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.chaos.processes import Owned

pytestmark = pytest.mark.timeout(120)

COST = [
    "pool_instances=4",
    "groups_per_step=8",
    "group_size=4",
    "max_seqs=16",
    "prompt_median=40",
    "prompt_max=120",
    "response_median=80",
    "response_max=400",
]
SCRIPT = """
import os, sys
from pathlib import Path
from dora.bench.cluster import CONFIG, emulated_placement, mode_overrides
from dora.bench.modes import run_mode
from dora.costs import apply_overrides, preset
from dora.sim.modes import plan
cost = {cost!r}
setup = apply_overrides(preset("paper-64"), cost)
settings = mode_overrides(
    setup, plan("sync", setup), preset_name="paper-64", cost=cost, steps=1000, scale=0.005
)
placement = emulated_placement("sync", sorted(os.sched_getaffinity(0)))
sys.exit(run_mode(str(CONFIG), settings, Path({out!r}), placement, steps=1000))
"""


def _children(pid: int) -> list[int]:
    with contextlib.suppress(FileNotFoundError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def _descendants(pid: int) -> list[int]:
    found = []
    for child in _children(pid):
        found += [child, *_descendants(child)]
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that is not ours to reap it counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.slow
def test_sigterm_stops_a_benchmark_run_and_everything_it_started(
    tmp_path: Path, owned: Owned
) -> None:
    script = SCRIPT.format(cost=COST, out=str(tmp_path / "run"))
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    owned.procs.append(proc)
    started: list[int] = []
    deadline = time.monotonic() + 90
    while len(started) < 3:  # serve, learn, and serve's emulated instances
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"started: {started}"
        time.sleep(0.2)
        owned.groups[:] = _children(proc.pid)  # the sides, in sessions of their own
        started = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    left = [pid for pid in started if _alive(pid)]
    assert not left, f"still running after the benchmark was stopped: {left}"
    assert proc.returncode != -signal.SIGTERM, "stopped its runs first, not killed mid-way"
