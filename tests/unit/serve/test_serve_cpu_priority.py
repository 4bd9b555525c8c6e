"""CPU priority by deadline: which instances keep the normal policy, and real processes moved to
SCHED_IDLE and back as the oldest version in flight moves."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dora.serve.cpu_priority import CpuPriority, foreground, may_lift_idle

VERSIONS = st.dictionaries(st.integers(0, 6), st.integers(1, 3), max_size=3)


@given(st.dictionaries(st.sampled_from("abcdef"), VERSIONS, min_size=1))
def test_the_oldest_version_in_flight_and_idle_instances_keep_the_cores(
    inflight: dict[str, dict[int, int]],
) -> None:
    normal = foreground(inflight)
    busy = [v for versions in inflight.values() for v in versions]
    for instance, versions in inflight.items():
        expected = not versions or min(busy) in versions
        assert (instance in normal) == expected, (instance, inflight)
    if busy:  # some instance with a call in flight always keeps the cores
        assert any(inflight[i] for i in normal)


def test_one_version_in_flight_leaves_every_instance_alone() -> None:
    assert foreground({"i0": {3: 2}, "i1": {3: 1}, "i2": {}}) == {"i0", "i1", "i2"}
    assert foreground({"i0": {3: 2, 4: 1}, "i1": {4: 5}, "i2": {5: 1}}) == {"i0"}


def _policies(pid: int) -> set[int]:
    """The policies of the process's threads but its main one, which keeps the normal policy."""
    assert os.sched_getscheduler(pid) == os.SCHED_OTHER
    tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid]
    assert tids
    return {os.sched_getscheduler(tid) for tid in tids}


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two processes with two threads each, stopped by their handles."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
    code += "print(flush=True); time.sleep(60)"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(2)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            proc.stdout.readline()  # both threads run
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()


@pytest.mark.skipif(not may_lift_idle(), reason="this process may not lift SCHED_IDLE again")
def test_processes_follow_the_oldest_version_in_flight(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    a, b = (proc.pid for proc in sleepers)
    priority = CpuPriority()
    priority.apply([("i0", a, {3: 1}), ("i1", b, {4: 2}), ("remote", None, {5: 1})])
    assert _policies(a) == {os.SCHED_OTHER} and _policies(b) == {os.SCHED_IDLE}
    assert priority.switches == 1
    priority.apply([("i0", a, {3: 1}), ("i1", b, {4: 1})])  # unchanged: no system call
    assert priority.switches == 1
    priority.apply([("i0", a, {5: 1}), ("i1", b, {4: 1})])  # i0's old call ended, a new began
    assert _policies(a) == {os.SCHED_IDLE} and _policies(b) == {os.SCHED_OTHER}
    priority.apply([("i0", a, {}), ("i1", b, {4: 1})])  # an idle instance keeps the cores
    assert _policies(a) == {os.SCHED_OTHER} and _policies(b) == {os.SCHED_OTHER}
    assert priority.switches == 4


@pytest.mark.skipif(not may_lift_idle(), reason="this process may not lift SCHED_IDLE again")
def test_a_process_that_is_gone_is_skipped(sleepers: list[subprocess.Popen[bytes]]) -> None:
    a, b = (proc.pid for proc in sleepers)
    sleepers[1].kill()
    sleepers[1].wait()
    priority = CpuPriority()
    priority.apply([("i0", a, {3: 1}), ("i1", b, {4: 1})])
    assert priority.switches == 0
    priority.apply([("i0", a, {5: 1}), ("i1", b, {4: 1})])
    assert _policies(a) == {os.SCHED_IDLE} and priority.switches == 1
