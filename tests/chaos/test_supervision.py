"""`dora run`'s supervisor with stand-in sides (plain Python processes): a side that keeps dying is
restarted `run.max_restarts` times, learn always with `--resume`, then both are stopped and the run
fails, naming the limit; a clean exit of both ends the run; Ctrl-C or SIGTERM stops both sides."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dora.errors import RunAborted
from dora.launch import Supervisor
from tests.chaos.processes import Owned

pytestmark = pytest.mark.timeout(60)

READY = "import os, pathlib; pathlib.Path(os.environ['DORA_READY_FILE']).touch()\n"
"""What a side runs once it started (`dora.lifetime.mark_ready`): later failures are restarted."""
SLEEP = READY + "import time; time.sleep(60)"


def _run(
    tmp_path: Path, serve: str, learn: str, max_restarts: int
) -> tuple[int, Supervisor, list[dict[str, object]]]:
    """Supervise stand-in sides until the run ends: its exit code, the supervisor, its records."""
    sup = Supervisor(
        serve_cmd=[sys.executable, "-c", serve],
        learn_cmd=[sys.executable, "-c", learn],
        env={},
        run_dir=tmp_path,
        max_restarts=max_restarts,
    )
    try:
        code = sup.run(resume=False)
    finally:
        sup.close()
    lines = (tmp_path / "supervisor.jsonl").read_text().splitlines()
    return code, sup, [json.loads(x) for x in lines]


def test_a_dying_serve_is_restarted_with_a_resumed_learn_until_the_limit(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, sup, records = _run(tmp_path, READY + "import sys; sys.exit(3)", SLEEP, max_restarts=2)
    assert code == 1
    exits = [r for r in records if r["kind"] == "exit"]
    assert [(r["component"], r["returncode"]) for r in exits] == [("serve", 3)] * 3
    starts = [(r["component"], r["resume"]) for r in records if r["kind"] == "start"]
    # serve and learn, then twice: serve resumed from its journal, learn resumed (it cannot greet
    # a new serve)
    assert starts == [("serve", False), ("learn", False)] + [("serve", True), ("learn", True)] * 2
    assert all(p.poll() is not None for p in sup.children.values()), "both sides stopped"
    assert "2 restarts used (run.max_restarts = 2)" in capfd.readouterr().err


def test_a_dying_learn_is_resumed_and_a_clean_finish_ends_the_run(tmp_path: Path) -> None:
    # learn fails on its first start and succeeds once resumed; serve finishes after a while
    learn = READY + "import sys; sys.exit(0 if '--resume' in sys.argv else 5)"
    code, _, records = _run(tmp_path, READY + "import time; time.sleep(1.5)", learn, max_restarts=1)
    assert code == 0
    assert [(r["component"], r.get("returncode")) for r in records if r["kind"] == "exit"] == [
        ("learn", 5)
    ]
    starts = [(r["component"], r["resume"]) for r in records if r["kind"] == "start"]
    assert starts == [("serve", False), ("learn", False), ("learn", True)]


@pytest.fixture(params=["foreground", "background"])
def sigint(request: pytest.FixtureRequest) -> Iterator[str]:
    """How `dora run` was started: a shell starts a background job (`dora run ... &` in a script,
    under nohup) with SIGINT ignored, a disposition its children inherit across exec unless the
    supervisor sees to it that they do not: they would sit out the SIGINT that stops them."""
    before = signal.getsignal(signal.SIGINT)
    if request.param == "background":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield request.param
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("side", ["serve", "learn"])
def test_a_side_that_fails_before_it_is_ready_stops_the_run_at_once(
    tmp_path: Path, side: str, sigint: str, capfd: pytest.CaptureFixture[str]
) -> None:
    failing = "import sys; print('bad model folder', file=sys.stderr); sys.exit(2)"
    serve, learn = (failing, SLEEP) if side == "serve" else (SLEEP, failing)
    started = time.monotonic()
    code, sup, records = _run(tmp_path, serve, learn, max_restarts=3)
    if sigint == "background":  # and the supervisor itself still ignores it, as it was told
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert code == 1
    assert time.monotonic() - started < 20, "stopped at once, not after the other side's sleep"
    starts = [r["component"] for r in records if r["kind"] == "start"]
    assert sorted(starts) == ["learn", "serve"], "started once each, never restarted"
    exits = [(r["component"], r["returncode"], r["ready"]) for r in records if r["kind"] == "exit"]
    assert exits == [(side, 2, False)]
    assert all(p.poll() is not None for p in sup.children.values()), "both sides stopped"
    err = capfd.readouterr().err
    assert f"{side} failed while starting (status 2), before it was ready" in err
    assert "bad model folder" in err  # learn's error comes from learn.log, serve's is on stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_both_sides(
    tmp_path: Path, sig: signal.Signals, owned: Owned
) -> None:
    script = (  # a terminal's Ctrl-C reaches a foreground `dora run`: SIGINT is not ignored
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import sys; from pathlib import Path; from dora.launch import Supervisor\n"
        f"sides = [sys.executable, '-c', {SLEEP!r}]\n"
        "sup = Supervisor(serve_cmd=sides, learn_cmd=sides, env={}, "
        f"run_dir=Path({str(tmp_path)!r}), max_restarts=1)\n"
        "sys.exit(sup.supervise(resume=False))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    owned.procs.append(proc)
    log = tmp_path / "supervisor.jsonl"
    deadline = time.monotonic() + 30
    while not (log.exists() and log.read_text().count('"start"') == 2):
        assert time.monotonic() < deadline and proc.poll() is None, "both sides started"
        time.sleep(0.05)
    pids = [int(r["pid"]) for r in map(json.loads, log.read_text().splitlines())]
    owned.groups += pids  # the sides run in sessions of their own
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=40)
    assert proc.returncode == 130 and "interrupted, stopping serve and learn" in err
    for pid in pids:  # reaped by the supervisor: gone, not even a zombie
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("side", ["serve", "learn"])
def test_a_side_that_aborts_the_run_is_not_restarted(
    tmp_path: Path, side: str, capfd: pytest.CaptureFixture[str]
) -> None:
    # a ready side that exits with RunAborted's status (every sample of a step masked, a
    # non-finite loss) would meet the same cause after a restart: the run stops at once
    aborting = READY + f"import sys; sys.exit({RunAborted.exit_code})"
    serve, learn = (aborting, SLEEP) if side == "serve" else (SLEEP, aborting)
    started = time.monotonic()
    code, sup, records = _run(tmp_path, serve, learn, max_restarts=3)
    assert code == 1
    assert time.monotonic() - started < 20, "stopped at once, not after the other side's sleep"
    assert [r["component"] for r in records if r["kind"] == "exit"] == [side]
    assert [r["component"] for r in records if r["kind"] == "start"] == ["serve", "learn"]
    assert all(p.poll() is not None for p in sup.children.values()), "both sides stopped"
    assert "not restarted: a restart would meet the same cause" in capfd.readouterr().err
