"""The run directory's lock and the resume checks, without a run: a live owner refuses every
other, naming its pid; a dead one (SIGKILL) holds nothing; its children share it; a resume names
every setting that would change the run and lets the safe ones through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dora.config import load_config
from dora.config_text import render_toml
from dora.errors import RunAborted
from dora.resume import SAFE_ON_RESUME, check_resume, keep_run_config, write_run_config
from dora.rundir import LOCKED_ENV, own_run_dir

pytestmark = pytest.mark.timeout(60)


def _try_lock(run_dir: Path, *sides: str, env: dict[str, str] | None = None) -> str:
    """Take `sides` of `run_dir` in another process: 'ok', or the refusal's message."""
    code = (
        "import sys; from pathlib import Path; from dora.rundir import own_run_dir\n"
        "from dora.errors import RunAborted\n"
        "try:\n"
        f"    with own_run_dir(Path({str(run_dir)!r}), {sides!r}, command='test'):\n"
        "        print('ok')\n"
        "except RunAborted as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_run_dir_lock_refuses_a_second_owner_naming_the_first(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with own_run_dir(run_dir, ("serve", "learn"), command="dora run"):
        for side in ("serve",):
            refused = _try_lock(run_dir, side)
            assert f"pid {os.getpid()} (dora run" in refused, refused
            assert str(run_dir) in refused and "log.run_dir" in refused, refused
        also_here = own_run_dir(run_dir, ("serve",), command="dora serve")
        with pytest.raises(RunAborted, match=f"pid {os.getpid()}"), also_here:
            pass
    assert _try_lock(run_dir, "serve", "learn") == "ok", "released at exit"


def test_run_dir_lock_of_a_killed_owner_is_free(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code = (
        "import time; from pathlib import Path; from dora.rundir import own_run_dir\n"
        f"with own_run_dir(Path({str(run_dir)!r}), ('serve', 'learn'), command='dora run'):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert f"pid {holder.pid}" in _try_lock(run_dir, "learn")
        holder.send_signal(signal.SIGKILL)
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.communicate()
    assert _try_lock(run_dir, "serve", "learn") == "ok", "a dead owner's lock is free"


def test_run_dir_lock_is_shared_with_the_children_it_names(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with own_run_dir(run_dir, ("serve", "learn"), command="dora run") as owner:
        assert _try_lock(run_dir, "serve", env=owner.env) == "ok"
        # a child told about another directory is refused like any stranger
        other = {LOCKED_ENV: str(tmp_path / "elsewhere")}
        assert f"pid {os.getpid()}" in _try_lock(run_dir, "serve", env=other)
        # the lock outlives its owner while a child that inherited it lives
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=owner.fds
        )
    try:
        time.sleep(0.2)
        assert "pid" in _try_lock(run_dir, "serve"), "still held by the child"
    finally:
        child.kill()
        child.wait()
    assert _try_lock(run_dir, "serve") == "ok"


def _saved(tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.toml").write_text(render_toml(load_config(None, list(overrides))))
    return run_dir


def test_resume_config_names_every_defining_change_and_lets_safe_ones_through(
    tmp_path: Path,
) -> None:
    run_dir = _saved(tmp_path, "rollout.group_size=8", "learn.lr=1e-6")
    check_resume(run_dir, load_config(None, ["rollout.group_size=8"]))
    safe = ["serve.request_timeout_s=5", "log.metrics_every_s=9", "data.eval_every=3"]
    check_resume(run_dir, load_config(None, ["rollout.group_size=8", *safe]))
    changed = load_config(None, ["rollout.group_size=4", "learn.lr=1e-5", "env.kwargs={a=1}"])
    with pytest.raises(RunAborted) as refused:
        check_resume(run_dir, changed)
    message = str(refused.value)
    assert "rollout.group_size: 8 -> 4" in message, message
    assert "learn.lr: 1e-06 -> 1e-05" in message, message
    assert "env.kwargs" in message and "serve.request_timeout_s" not in message, message
    assert "docs/config.md" in message, message


def test_resume_config_safe_keys_exist() -> None:
    from dora.config_text import field_docs

    keys = {key for key, *_ in field_docs()}
    for safe in SAFE_ON_RESUME:
        assert safe in keys or any(k.startswith(f"{safe}.") for k in keys), safe


def test_resume_config_is_compared_by_serve_started_on_its_own(
    tmp_path: Path,
) -> None:
    """`dora serve --resume` by hand refuses a change to a setting that defines the run, naming
    it, before it loads anything: as `dora run --resume` does."""
    run_dir = tmp_path / "run"
    config = tmp_path / "config.toml"
    config.write_text(render_toml(load_config(None, ["rollout.group_size=8"])))
    run_dir.mkdir()
    write_run_config(run_dir, load_config(None, ["rollout.group_size=8"]))
    (run_dir / "journal").mkdir()
    (run_dir / "journal" / "queue.msgpack").write_bytes(b"")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "incarnation").write_text("0")
    for side in ("serve",):
        command = [sys.executable, "-m", "dora.cli", side, str(config)]
        command += ["rollout.group_size=4", f"log.run_dir={run_dir}", "--resume"]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0, (side, proc.stdout, proc.stderr)
        assert "rollout.group_size: 8 -> 4" in proc.stderr, (side, proc.stderr)


def test_resume_config_record_is_owner_only_and_holds_no_token(tmp_path: Path) -> None:
    config = load_config(None, ["serve.token=s3cret-token", "rollout.group_size=8"])
    tmp_path.chmod(0o755)
    write_run_config(tmp_path, config)
    path = tmp_path / "config.toml"
    assert path.stat().st_mode & 0o777 == 0o600
    assert "s3cret-token" not in path.read_text()
    assert load_config(str(path), []).rollout.group_size == 8
    keep_run_config(tmp_path, config, resume=True)  # the token is no setting of the run
