"""The episode runners `dora serve` starts on its own host (`serve.runners = N`).

Each is `python -m dora.cli runner --connect ADDRESS --name local-I CONFIG log.run_dir=RUN_DIR`
with the run's config saved for it in the run directory (`runner-config.toml`, owner-only,
without the token) and the token in its environment (`DORA_RUNNER_TOKEN`: never on a command
line). A runner that exits is declared lost at once (its episodes run again elsewhere,
`runners.RunnerHub.lose_named`) and started again, at most `3 * N` times in a run; past that
serve stops with the error. Stopping serve stops every runner by its handle (SIGTERM, then
SIGKILL after a grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path

from dora.config import DoraConfig
from dora.errors import ServerUnavailable
from dora.resume import write_run_config
from dora.serve.runners import RunnerHub

__all__ = ["LocalRunners", "local_runner_names"]

log = logging.getLogger("dora.serve")

STOP_GRACE_S = 5.0


class LocalRunners:
    """Serve's own runner processes, kept running while serve runs."""

    def __init__(self, config: DoraConfig, *, hub: RunnerHub, run_dir: Path) -> None:
        self._count = config.serve.runners
        self._token = config.serve.token
        self._hub = hub
        self._run_dir = run_dir
        self._config_path = run_dir / "runner-config.toml"
        write_run_config(run_dir, config, name=self._config_path.name)
        self.restarts = 0
        self._procs: dict[str, asyncio.subprocess.Process] = {}

    async def run(self) -> None:
        """Start the runners and start again those that exit; stops them all when cancelled."""
        try:
            async with asyncio.TaskGroup() as tg:
                for name in local_runner_names(self._count):
                    tg.create_task(self._keep(name), name=f"runner-{name}")
        finally:
            await asyncio.shield(self._stop_all())

    def pids(self) -> dict[str, int]:
        """The pid of each runner process running now, by name."""
        return {name: proc.pid for name, proc in self._procs.items()}

    async def _keep(self, name: str) -> None:
        while True:
            proc = await self._start(name)
            code = await proc.wait()
            self._procs.pop(name, None)
            self._hub.lose_named(name, f"its process exited with {code}")
            if self.restarts >= 3 * self._count:
                raise ServerUnavailable(
                    f"runner {name} exited with {code}; {self.restarts} runner restarts already"
                )
            self.restarts += 1
            log.warning("runner %s exited with %d: starting it again", name, code)

    async def _start(self, name: str) -> asyncio.subprocess.Process:
        argv = [sys.executable, "-m", "dora.cli", "runner", "--connect", self._hub.address]
        argv += ["--name", name, str(self._config_path), f"log.run_dir={self._run_dir}"]
        env = {**os.environ, "DORA_RUNNER_TOKEN": self._token}
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdin=asyncio.subprocess.DEVNULL
        )
        self._procs[name] = proc
        return proc

    async def _stop_all(self) -> None:
        procs = list(self._procs.values())
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in procs:
            try:
                async with asyncio.timeout(STOP_GRACE_S):
                    await proc.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self._procs.clear()


def local_runner_names(count: int) -> list[str]:
    """The names of the runners serve starts: `local-0`, `local-1`, ..."""
    return [f"local-{i}" for i in range(count)]
