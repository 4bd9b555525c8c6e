"""`dora run`: `dora serve` and `dora learn` on one machine, started and stopped together.

Both sides get the same resolved config, the same run directory and a free port for the trainer
link, chosen here so neither has to tell the other. Unless the config sets `serve.token`, the run
directory gets the run's secret (`dora/secret.py`), which both sides read from there as their
token: the trainer link and the engines' control routes are authenticated by default. Serve owns
the terminal (its live display is the run's one progress display); the trainer writes to
`learn.log` in the run directory.

Supervision (docs/reliability.md): a side that exits with an error is restarted, at most
`run.max_restarts` times each. A dead `dora learn` is restarted with `--resume`: it continues from
its last checkpoint under a new incarnation and serve rolls back. A dead `dora serve` is restarted
on the same run directory and port, with `--resume`: it restores its journal
(`dora/serve/journal.py`), which must be there. The trainer
is restarted with it (`--resume`), because a trainer's link has no way to say hello to a new serve
but to start again; the groups of its non-durable steps come back from serve's journal. Whatever
is left of a dead side (its process group: instances, ranks) is killed first. Each exit and
restart is a line in `{run_dir}/supervisor.jsonl`. When a side fails once more than allowed, the
other is stopped and `dora run` exits 1, naming the side and the limit.

The run directory is owned by one run (`dora/rundir.py`): `dora run` locks it before it writes
anything there and hands the lock to the sides it starts, so a second `dora run` on it is refused
naming this one's pid. `--resume` needs `log.run_dir`, and what it continues is checked before
anything starts (`dora/resume.py`): the run's config and journal are there, and no setting that
defines the run changed; a new run refuses a directory that holds another's journal.

Restarts are for faults during a run. A side that fails before it is ready (a bad config, a model
folder that cannot serve the environment, a dataset that does not load) would fail again the same
way, so it is not restarted: the other side is stopped at once and `dora run` exits 1 with the
side's error (serve's is on the terminal already; learn's last lines are printed from
`learn.log`). Likewise a side that exits with `RunAborted.exit_code` (every sample of a step
masked, a non-finite loss: a restart would meet the same data and weights; a run directory that
cannot continue, `RunDirError`: a cut journal, a missing checkpoint) stops the run at once.
A side is ready when it calls `dora.lifetime.mark_ready()`, which creates the file `dora run`
names in `DORA_READY_FILE`: serve once its instances are up and every prompt was measured, learn
once its model and optimizer are loaded.

Stopping: Ctrl-C (or SIGTERM), or the limit, stops both: SIGINT first, then SIGTERM after a
grace period, then SIGKILL. Every child runs in its own process group so that the trainer's own
worker ranks (torchrun) and the serve side's inference instances go down with their parent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dora.config import DoraConfig, config_from_raw, load_config
from dora.config_file import raw_config
from dora.config_text import default_sections
from dora.dryrun import planned, process_lines, thread_overrides
from dora.errors import RunAborted
from dora.gpu_plan import GpuPlan
from dora.lifetime import READY_ENV
from dora.net import free_port
from dora.resume import check_fresh, check_resumable, check_resume, write_run_config
from dora.rundir import RunDirOwner, own_run_dir, resolve_run_dir
from dora.secret import create_run_secret

GRACE_S = 20.0
LOG_TAIL_LINES = 30


def main(args: argparse.Namespace) -> int:
    raw = raw_config(args.config, args.overrides)
    config = config_from_raw(raw)
    for note in default_sections(raw):
        print(f"dora run: {note}", flush=True)
    args.overrides = [*args.overrides, *thread_overrides(raw, args.overrides, config)]
    start = planned(args.config, args.overrides)  # refused here, before anything is written
    config, plan, args.overrides = start.config, start.plan, start.overrides
    from dora.models.prepare import prepare_model

    # both sides then start from these exact weights; a model.path that is not there is refused
    # before the run directory exists
    model_dir = prepare_model(config)
    run_dir = resolve_run_dir(config, resume=args.resume)
    # Owned before anything is written; a resume checks what it continues (dora/resume.py).
    with own_run_dir(run_dir, ("serve", "learn"), command="dora run") as owner:
        (check_resumable if args.resume else check_fresh)(run_dir)
        return _run(args, config, run_dir, owner, model_dir=model_dir, plan=plan)


def _run(
    args: argparse.Namespace,
    config: DoraConfig,
    run_dir: Path,
    owner: RunDirOwner,
    *,
    model_dir: Path,
    plan: GpuPlan,
) -> int:
    if not config.serve.token:
        create_run_secret(run_dir)  # both sides read it from there (dora/secret.py)
    port = config.serve.port or free_port(config.serve.host)
    overrides = [
        *args.overrides,
        f"serve.port={port}",
        f"log.run_dir={run_dir}",
        f"model.path={model_dir}",
        "model.warmup_steps=0",
    ]
    resolved = load_config(args.config, overrides)
    if args.resume:
        check_resume(run_dir, resolved)
    write_run_config(run_dir, resolved)
    print(f"dora run: run directory {run_dir}", flush=True)
    for line in process_lines(config, plan, weights=str(model_dir)):
        print(f"dora run: {line}", flush=True)

    cli = [sys.executable, "-m", "dora.cli"]
    env = {
        "OMP_WAIT_POLICY": "PASSIVE",
        **os.environ,
        "DORA_SERVE_ADDRESS": f"tcp://{config.serve.host}:{port}",
        **owner.env,
    }
    supervisor = Supervisor(
        serve_cmd=[*cli, "serve", args.config, *overrides],
        learn_cmd=[*cli, "learn", args.config, *overrides],
        env=env,
        run_dir=run_dir,
        max_restarts=config.run.max_restarts,
        pass_fds=owner.fds,
    )
    code = supervisor.supervise(resume=args.resume)
    if code == 0:
        print(f"dora run: finished; run directory {run_dir}", flush=True)
    return code


class Supervisor:
    """Starts serve and learn, restarts the one that dies (see the module docstring)."""

    def __init__(
        self,
        *,
        serve_cmd: list[str],
        learn_cmd: list[str],
        env: dict[str, str],
        run_dir: Path,
        max_restarts: int,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.serve_cmd, self.learn_cmd, self.env = serve_cmd, learn_cmd, env
        self.pass_fds = pass_fds  # the run directory's locks, shared with the sides
        self.run_dir = run_dir
        self.max_restarts = max_restarts
        self.restarts = {"serve": 0, "learn": 0}
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self._learn_log = open(run_dir / "learn.log", "ab")  # noqa: SIM115 (closed by close())
        self._log = open(run_dir / "supervisor.jsonl", "a")  # noqa: SIM115

    def supervise(self, *, resume: bool) -> int:
        """`run` until the run ends (its exit code); Ctrl-C or SIGTERM stops both sides (130)."""
        try:
            with sigterm_interrupts():
                return self.run(resume=resume)
        except KeyboardInterrupt:
            print("\ndora run: interrupted, stopping serve and learn", file=sys.stderr)
            stop_all(self.children)
            return 130
        finally:
            self.close()

    def run(self, *, resume: bool) -> int:
        """Start both sides, restart the one that dies; 0 when both finished, 1 past the limit."""
        self._start("serve", resume=resume)
        self._start("learn", resume=resume)
        while True:
            failed = _wait_first_failure(self.children)
            if failed is None:
                return 0
            code = self.children[failed].returncode
            ready = self._ready_file(failed).exists()
            self._record("exit", failed, returncode=code, ready=ready)
            if not ready:
                self._failed_at_start(failed, code)
                return 1
            if code == RunAborted.exit_code:
                print(
                    f"dora run: {failed} stopped the run (status {code}, its error above); it is "
                    "not restarted: a restart would meet the same cause; stopping the other side "
                    f"(logs in {self.run_dir})",
                    file=sys.stderr,
                    flush=True,
                )
                stop_all(self.children)
                return 1
            serve_done = failed == "learn" and self.children["serve"].returncode == 0
            if serve_done or self.restarts[failed] >= self.max_restarts:
                why = (
                    "serve had finished the run"
                    if serve_done
                    else f"{self.restarts[failed]} restarts used (run.max_restarts = "
                    f"{self.max_restarts})"
                )
                print(
                    f"dora run: {failed} exited with status {code}, {why}; not restarting it; "
                    f"stopping the other side (logs in {self.run_dir})",
                    file=sys.stderr,
                )
                stop_all(self.children)
                return 1
            self.restarts[failed] += 1
            print(
                f"dora run: {failed} exited with status {code}; restarting it "
                f"({self.restarts[failed]} of {self.max_restarts})",
                file=sys.stderr,
                flush=True,
            )
            _kill_group(self.children[failed])
            if failed == "serve":
                # The trainer cannot say hello to a new serve but by starting again (resumed).
                _kill_group(self.children["learn"])
                self._start("serve", resume=True)
            self._start("learn", resume=True)

    def _failed_at_start(self, name: str, code: int) -> None:
        """A side failed before it was ready: say so with its error, and stop the other one."""
        tail = ""
        if name == "learn":
            self._learn_log.flush()
            lines = (self.run_dir / "learn.log").read_text(errors="replace").splitlines()
            tail = "\n".join(lines[-LOG_TAIL_LINES:]) + "\n"
        print(
            f"{tail}dora run: {name} failed while starting (status {code}), before it was ready; "
            "it is not restarted, since it would fail the same way (restarts are for faults "
            f"during a run); stopping the other side (logs in {self.run_dir})",
            file=sys.stderr,
            flush=True,
        )
        stop_all(self.children)

    def _ready_file(self, name: str) -> Path:
        return self.run_dir / f".{name}.ready"

    def _start(self, name: str, *, resume: bool = False) -> None:
        ready = self._ready_file(name)
        ready.unlink(missing_ok=True)
        env = {**self.env, READY_ENV: str(ready)}
        cmd = self.serve_cmd if name == "serve" else self.learn_cmd
        cmd = [*cmd, *(["--resume"] if resume else [])]
        if name == "serve":
            proc = start_side(cmd, env=env, pass_fds=self.pass_fds)
        else:
            proc = start_side(
                cmd,
                env=env,
                stdout=self._learn_log,
                stderr=subprocess.STDOUT,
                pass_fds=self.pass_fds,
            )
        self.children[name] = proc
        self._record("start", name, pid=proc.pid, resume=resume, restart=self.restarts[name])

    def _record(self, kind: str, component: str, **fields: object) -> None:
        line = {"kind": kind, "component": component, "time": time.time(), **fields}
        self._log.write(json.dumps(line) + "\n")
        self._log.flush()

    def close(self) -> None:
        self._learn_log.close()
        self._log.close()


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt as Ctrl-C does, so that the cleanup
    that stops the sides (`stop_all`) runs when the launcher is stopped from outside (`timeout`,
    `kill`, a cancelled CI job) too: the sides live in sessions of their own and would outlive
    it. Signal handlers can only be set in the main thread; elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def start_side(cmd: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start a side in a process group (session) of its own, stopped by `stop_all`.

    `stop_all` asks a side to stop with SIGINT, so the side must not ignore it. A shell starts a
    background job (`dora run ... &` in a script) with SIGINT ignored, and an ignored signal stays
    ignored across exec: the side would sit out the grace period. A handled signal is reset to
    the default at exec, so while the side starts, an ignored SIGINT is handled here by doing
    nothing (this process goes on ignoring it) and the side gets the default.
    """
    swap = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    swap &= threading.current_thread() is threading.main_thread()  # where signals can be set
    if swap:
        signal.signal(signal.SIGINT, _ignore)
    try:
        return subprocess.Popen(cmd, start_new_session=True, **popen)
    finally:
        if swap:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _ignore(signum: int, frame: object) -> None:
    pass


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of a side (its process group: instances, ranks) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait_first_failure(children: dict[str, subprocess.Popen[bytes]]) -> str | None:
    """Block until every child exited 0 (None) or one failed (its name)."""
    while True:
        running = 0
        for name, proc in children.items():
            code = proc.poll()
            if code is None:
                running += 1
            elif code != 0:
                return name
        if running == 0:
            return None
        # wait for any child to exit without reaping it; poll() above then reaps and reads it
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)


def stop_all(children: dict[str, subprocess.Popen[bytes]]) -> None:
    for sig, wait_s in ((signal.SIGINT, GRACE_S), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in children.values() if p.poll() is None]
        if not alive:
            return
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
