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
