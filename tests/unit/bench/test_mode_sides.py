"""`dora bench modes` and `dora bench cluster` stop a mode's run when one side fails, whichever
side it is: a `dora learn` that refused its run directory at start left `dora serve` waiting for
a trainer (up to an hour) while the benchmark waited for serve."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from dora.bench.modes import first_failure, sides_ended

pytestmark = pytest.mark.timeout(30)


def side(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_side_that_fails_ends_the_run_while_the_other_still_runs() -> None:
    serve, learn = side("import time; time.sleep(60)"), side("raise SystemExit(1)")
    try:
        learn.wait(10)
        assert sides_ended([serve, learn]), "serve listed first must not hide learn's failure"
        assert serve.poll() is None
        # what the benchmark reports: learn's own error, not serve's code once it is stopped
        assert first_failure({"serve": serve, "learn": learn}) == ("learn", 1)
    finally:
        serve.kill()
        serve.wait()


def test_the_run_goes_on_while_a_side_runs_and_ends_when_all_exit_well() -> None:
    serve, learn = side("import time; time.sleep(0.5)"), side("pass")
    learn.wait(10)
    assert not sides_ended([serve, learn])
    serve.wait(10)
    time.sleep(0.01)
    assert sides_ended([serve, learn])
    assert first_failure({"serve": serve, "learn": learn}) is None


class Steps:
    """The trained-step count a `_Window` polls, set by the test."""

    def __init__(self) -> None:
        self.n = 0

    def poll(self) -> int:
        return self.n


def test_a_cpu_sample_after_a_side_exited_is_not_kept() -> None:
    """A side that exited (and was reaped) reads as 0 CPU-seconds: a window ending at such a
    sample measured negative CPU and printed a negative machine bound."""
    from dora.bench.modes import _Window
    from dora.bench.proc import tree_cpu_s

    burn = "import time\nwhile time.process_time() < 0.3: pass\ntime.sleep(60)"
    serve, learn = side("import time; time.sleep(60)"), side(burn)
    procs = {"serve": serve, "learn": learn}
    steps = Steps()
    window = _Window(steps, first=1, last=3)  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 10
        while tree_cpu_s([learn.pid]) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        steps.n = 1
        window.sample(procs)
        learn.kill()
        learn.wait(10)
        steps.n = 3  # the last step was trained, and learn has exited since
        window.sample(procs)
        record = window.record(procs)
        assert record, "the window's first end was sampled"
        assert all(v >= 0 for k, v in record.items() if k.endswith("cpu_s")), record
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
