"""`dora run`: `dora serve` and `dora learn` on one machine, started and stopped together.

Both sides get the same resolved config, the same run directory and a free port for the trainer
link, chosen here so neither has to tell the other. Serve owns the terminal (its live display is
the run's one progress display); the trainer writes to `learn.log` in the run directory.

Stopping: Ctrl-C, or either side exiting, stops the other: SIGINT first, then SIGTERM after a
grace period, then SIGKILL. Every child runs in its own process group so that the trainer's own
worker ranks (torchrun) and the serve side's inference instances go down with their parent.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from dora.config import DoraConfig, load_config, render_toml
from dora.errors import NotYetAvailable

GRACE_S = 20.0


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def make_run_dir(config: DoraConfig) -> Path:
    if config.log.run_dir:
        run_dir = Path(config.log.run_dir)
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / f"{config.log.name}-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def main(args: argparse.Namespace) -> int:
    for side in ("dora.serve.main", "dora.learn.main"):
        try:
            found = importlib.util.find_spec(side) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise NotYetAvailable(f"{side} is not in this version yet")
    config = load_config(args.config, args.overrides)
    run_dir = make_run_dir(config)
    port = config.serve.port or free_port(config.serve.host)
    from dora.models.prepare import prepare_model

    model_dir = prepare_model(config)  # both sides then start from these exact weights
    overrides = [
        *args.overrides,
        f"serve.port={port}",
        f"log.run_dir={run_dir}",
        f"model.path={model_dir}",
        "model.warmup_steps=0",
    ]
    (run_dir / "config.toml").write_text(render_toml(load_config(args.config, overrides)))
    print(f"dora run: run directory {run_dir}", flush=True)

    cli = [sys.executable, "-m", "dora.cli"]
    learn_cmd = [*cli, "learn", args.config, *overrides]
    if args.resume:
        learn_cmd.append("--resume")
    serve_cmd = [*cli, "serve", args.config, *overrides]
    env = {**os.environ, "DORA_SERVE_ADDRESS": f"tcp://{config.serve.host}:{port}"}

    with open(run_dir / "learn.log", "ab") as learn_log:
        serve = subprocess.Popen(serve_cmd, env=env, start_new_session=True)
        learn = subprocess.Popen(
            learn_cmd, env=env, stdout=learn_log, stderr=subprocess.STDOUT, start_new_session=True
        )
        children = {"serve": serve, "learn": learn}
        try:
            failed = _wait_first_failure(children)
        except KeyboardInterrupt:
            print("\ndora run: interrupted, stopping serve and learn", file=sys.stderr)
            stop_all(children)
            return 130
        if failed:
            print(
                f"dora run: {failed} exited with status {children[failed].returncode}; "
                f"stopping the other side (logs in {run_dir})",
                file=sys.stderr,
            )
            stop_all(children)
            return 1
    print(f"dora run: finished; run directory {run_dir}", flush=True)
    return 0


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
