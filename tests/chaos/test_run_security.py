"""`dora run` with default settings is authenticated, attacked as another local process would.

`dora run` creates the run's secret (owner-only, mode 0600) in the run directory; serve, the
trainer and the engines serve starts use it as their token. While the run trains, from loopback:
- the engines refuse an unauthenticated (or wrongly authenticated) `POST /control/pause`,
  `/control/import` and `/control/load_weights` (401; nothing is paused or loaded);
- rogue peers on the trainer link say `Hello` with incarnation -1, the current one, the next one,
  current + 1000 and `2**62`, without the token and with the secret itself: none gets a group or
  an answer, serve never rolls back, and the run finishes (exit 0).
The secret is in no log and not in the run's `config.toml`.
"""

from __future__ import annotations

import json
import stat
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from dora.errors import ServerTimeout
from dora.link import LearnLink
from dora.protocol import Hello, Refused
from tests.chaos.processes import Owned
from tests.chaos.test_chaos import EXAMPLE, _instances, _side
from tests.commands import start_dora_run

pytestmark = pytest.mark.timeout(300)

STEPS = 6
ROUTES = ("/control/pause", "/control/import", "/control/load_weights")
CLAIMS = [(-1, 0), (0, 0), (1, 0), (1, 2), (1000, 2), (2**62, 2)]
"""(incarnation, step) of the rogue hellos; the trainer is incarnation 0."""


def _engine_urls(run_pid: int, deadline: float) -> list[str]:
    """The loopback URLs of the engines serve started, once they answer `/health`."""
    while time.monotonic() < deadline:
        serve = _side(run_pid, "serve")
        urls = []
        for pid in _instances(serve) if serve else []:
            try:
                conns = psutil.Process(pid).net_connections(kind="tcp")
            except psutil.Error:
                continue
            urls += [f"http://127.0.0.1:{c.laddr.port}" for c in conns if c.status == "LISTEN"]
        if urls and all(_status(f"{u}/health", None) == 200 for u in urls):
            return urls
        time.sleep(0.2)
    raise TimeoutError("no engine of serve's answered /health")


def _status(url: str, token: str | None, body: bytes | None = None) -> int:
    """The HTTP status of a GET (no body) or POST to `url`."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _trained(run_dir: Path) -> int:
    path = run_dir / "learn-metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
def test_dora_run_secret_control_auth_and_rogue_trainer(tmp_path: Path, owned: Owned) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        f"learn.steps={STEPS}",
        "learn.checkpoint_every=2",
        "rollout.batch_size=2",
        "rollout.group_size=4",
        "rollout.max_tokens=32",
        "serve.instances=1",
        "serve.max_running=16",
        "model.warmup_steps=10",
        "data.eval_source=",
        "log.progress=false",
        f"log.run_dir={run_dir}",
    ]
    log = tmp_path / "dora-run.log"
    run = start_dora_run(EXAMPLE, overrides, log=log, cwd=tmp_path)
    owned.procs.append(run)  # type: ignore[arg-type]
    owned.groups.append(run.pid)
    deadline = time.monotonic() + 200
    urls = _engine_urls(run.pid, deadline)
    for pid in (_side(run.pid, "serve"), _side(run.pid, "learn")):
        if pid is not None:
            owned.groups.append(pid)

    secret_file = run_dir / "secret"
    assert secret_file.exists(), "dora run made the run's secret"
    info = secret_file.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600, oct(info.st_mode)
    secret = secret_file.read_text().strip()
    assert len(secret) == 64

    for url in urls:
        for route in ROUTES:
            for token in (None, "not-the-secret"):
                body = json.dumps({"version": 99, "path": "/nonexistent"}).encode()
                assert _status(f"{url}{route}", token, body) == 401, (route, token)
        assert _status(f"{url}/health", None) == 200, "nothing was paused"

    port = tomllib.loads((run_dir / "config.toml").read_text())["serve"]["port"]
    while _trained(run_dir) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    rogues: list[tuple[LearnLink, str]] = []
    try:
        for incarnation, step in CLAIMS:
            for token in ("", secret):
                rogue = LearnLink(f"tcp://127.0.0.1:{port}")
                rogue.send(Hello(role="learn", incarnation=incarnation, step=step, token=token))
                rogues.append((rogue, token))
        assert run.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, log.read_text()
        for rogue, token in rogues:  # at most the reason, and only to a holder of the secret
            try:
                got = rogue.recv(timeout_s=0.2, waiting_for="anything from serve")
            except ServerTimeout:
                continue
            assert token and isinstance(got, Refused), got
    finally:
        for rogue, _ in rogues:
            rogue.close()

    assert _trained(run_dir) == STEPS
    rollout = (run_dir / "rollout.jsonl").read_text()
    assert '"kind":"rollback"' not in rollout
    for path in (log, run_dir / "learn.log", run_dir / "config.toml", run_dir / "rollout.jsonl"):
        assert secret not in path.read_text(), f"the secret is in {path.name}"
