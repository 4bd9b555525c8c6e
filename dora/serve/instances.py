"""The instance pool: start N inference instances, hand out their clients, stop them by handle.

`dora serve` starts each embedded instance as its own process (`python -m dora.engine`), so the
instances decode in parallel and a crashing model cannot take the rollout loop down. Tests may start
them in this process (`EngineServer`) to save the seconds a process costs; both give the same
`InstanceHandle`s, and nothing above this module knows which kind it got. `attach` uses engines
that are already running (`serve.urls`).

A `ProcessPool` can start more instances while it runs: `dora serve` replaces an instance that
died (`InstanceLifecycle`); a replacement gets the next free id (`i3` after `i0`..`i2`) and the
GPU of the instance it replaces.

Each instance started here runs where the GPU plan (`dora.gpu_plan`) puts it: its
`CUDA_VISIBLE_DEVICES` is the plan's entry for its slot and it computes on that GPU
(`--device cuda`); with no GPU for it, every GPU is hidden from it and it computes on the CPU.

Engines this pool starts bind 127.0.0.1 whatever `serve.host` says: they are serve's private
children (dora serve, on this host, is their only client, as with the vLLM servers the launcher
starts), so nothing off this machine can reach them. With `serve.token` set they get it too (a
process reads it from `DORA_ENGINE_TOKEN`, never from its command line, which any local user can
read) and every client sends it: control then needs the token even from loopback. Engines at
`serve.urls` are someone else's; their clients send the token when one is set.

An engine process dies with the serve that started it, also when serve is SIGKILLed
(`dora/lifetime.py`): serve passes its pid, and the engine asks Linux for a parent-death signal.

Every instance starts with version 0 (the model folder) loaded. Stopping goes through the handle
that started the instance (the process object, or the in-process server's context): SIGTERM, a
bounded wait, then SIGKILL; never a search by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dora.errors import ServerTimeout, ServerUnavailable
from dora.instance import EngineClient, InstanceClient, InstanceHandle
from dora.lifetime import PARENT_ENV

if TYPE_CHECKING:
    from dora.config import DoraConfig
    from dora.gpu_plan import GpuPlan

__all__ = [
    "InstanceClient",
    "InstanceHandle",
    "InstanceSpec",
    "ProcessPool",
    "attach",
    "engine_args",
    "engine_env",
    "start_in_process",
    "start_processes",
]

log = logging.getLogger("dora.serve")

STALL_S = 10.0
"""The shortest stall bound serve gives its engines (`python -m dora.engine --stall-s`)."""


@dataclass(frozen=True, kw_only=True)
class InstanceSpec:
    """How to start embedded instances (always on 127.0.0.1: see the module docstring)."""

    model_dir: str
    token: str = ""
    """Bearer token of the engines' control endpoints ('' is none: loopback callers only)."""
    threads: int = 1
    dtype: str = "float32"
    """`model.dtype`: the weights' dtype in the engine."""
    max_running: int = 64
    max_model_len: int | None = None
    request_timeout_s: float = 600.0
    control_timeout_s: float = 120.0
    start_timeout_s: float = 120.0
    stall_s: float = STALL_S
    """How long an engine's step or command may last before its `/health` says stalled: serve's
    health deadline, but never under 10 s (a step of a loaded machine may take seconds, and a
    short deadline is meant for hung processes, not slow steps)."""
    devices: tuple[str, ...] = ()
    """`CUDA_VISIBLE_DEVICES` of each instance slot (the GPU plan's); () or '': the CPU."""

    @classmethod
    def from_config(
        cls, config: DoraConfig, model_dir: str | Path, *, plan: GpuPlan | None = None
    ) -> InstanceSpec:
        """The instances `serve.*` and `model.max_model_len` describe, of the model in
        `model_dir` (a load gets `serve.weight_load_timeout_s`, and so does a start), on the
        GPUs `plan` gives them (None: the CPU)."""
        serve = config.serve
        devices: tuple[str, ...] = ()
        if plan is not None and any(plan.instances):
            devices = tuple(plan.instance_env(i) for i in range(len(plan.instances)))
        return cls(
            devices=devices,
            model_dir=str(model_dir),
            token=serve.token,
            threads=serve.threads_per_instance,
            dtype=config.model.dtype,
            max_running=serve.max_running,
            max_model_len=config.model.max_model_len,
            request_timeout_s=serve.request_timeout_s,
            control_timeout_s=serve.weight_load_timeout_s,
            start_timeout_s=serve.weight_load_timeout_s,
            stall_s=max(serve.health_timeout_s, STALL_S),
        )


def _client(url: str, spec: InstanceSpec) -> EngineClient:
    return EngineClient(
        url,
        timeout_s=spec.request_timeout_s,
        control_timeout_s=spec.control_timeout_s,
        token=spec.token or None,
    )


class ProcessPool:
    """Engine processes started by this pool, and stopped by it (every one, on exit)."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self.handles: list[InstanceHandle] = []
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._slots: dict[str, int] = {}
        """The slot (in `spec.devices`) of each instance started."""
        self._started = 0

    async def start(self, count: int, *, slot: int | None = None) -> list[InstanceHandle]:
        """Start `count` more instances concurrently, in the next slots (or all in `slot`)."""
        first, self._started = self._started, self._started + count
        ids = [f"i{i}" for i in range(first, first + count)]
        for i, instance_id in enumerate(ids, start=first):
            self._slots[instance_id] = i if slot is None else slot
        async with asyncio.TaskGroup() as tg:
            starts = [
                tg.create_task(
                    _start_process(self.spec, instance_id, self._slots[instance_id], self._procs)
                )
                for instance_id in ids
            ]
        handles = [s.result() for s in starts]
        self.handles += handles
        return handles

    async def replace(self, dead: str) -> InstanceHandle:
        """A new instance in place of `dead`, whose process is killed first: it was declared dead
        (gone, or hung past its health deadline), so nothing it holds is wanted, and a hung
        process would not act on SIGTERM."""
        proc = self._procs.get(dead)
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        (handle,) = await self.start(1, slot=self._slots.get(dead))
        return handle

    async def close(self) -> None:
        for h in self.handles:
            await h.client.close()
        await asyncio.gather(*(_stop_process(p) for p in self._procs.values()))


@contextlib.asynccontextmanager
async def start_processes(spec: InstanceSpec, count: int) -> AsyncIterator[ProcessPool]:
    """Start `count` engine processes concurrently; stop every one the pool started on exit."""
    pool = ProcessPool(spec)
    try:
        await pool.start(count)
        yield pool
    finally:
        await pool.close()


def _gpus(spec: InstanceSpec, slot: int) -> str:
    """`CUDA_VISIBLE_DEVICES` of the instance in `slot` ('': none, the CPU)."""
    return spec.devices[slot % len(spec.devices)] if spec.devices else ""


def engine_args(spec: InstanceSpec, slot: int = 0) -> list[str]:
    """The arguments of `python` that start the engine process in `slot` of `spec`."""
    device = "cuda" if _gpus(spec, slot) else "cpu"
    args = [
        *("-m", "dora.engine", "--model", spec.model_dir, "--host", "127.0.0.1", "--port", "0"),
        *("--version", "0", "--threads", str(spec.threads), "--dtype", spec.dtype),
        *("--device", device),
        *("--max-running", str(spec.max_running), "--stall-s", str(spec.stall_s)),
    ]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    return args


def engine_env(spec: InstanceSpec, slot: int, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of the engine process in `slot`, from `base` (serve's own)."""
    # Progress bars of model loading from N processes would garble the terminal.
    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", **base}
    # Its GPU from the plan, or none: an engine on the CPU takes no GPU of another process's.
    env["CUDA_VISIBLE_DEVICES"] = _gpus(spec, slot)
    env.pop("DORA_ENGINE_TOKEN", None)  # only serve.token, never one inherited by accident
    if spec.token:
        env["DORA_ENGINE_TOKEN"] = spec.token
    env[PARENT_ENV] = str(os.getpid())  # it dies with this serve (dora/lifetime.py)
    return env


async def _start_process(
    spec: InstanceSpec, instance_id: str, slot: int, procs: dict[str, asyncio.subprocess.Process]
) -> InstanceHandle:
    args = engine_args(spec, slot)
    env = engine_env(spec, slot, os.environ)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        env=env,
    )
    procs[instance_id] = proc
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(spec.start_timeout_s):
            line = await proc.stdout.readline()
    except TimeoutError:
        raise ServerTimeout(
            f"instance {instance_id} (pid {proc.pid}) did not print its URL within "
            f"{spec.start_timeout_s:g} s while loading {spec.model_dir}"
        ) from None
    url = line.decode().strip()
    if not url.startswith("http"):
        code = proc.returncode
        raise ServerUnavailable(
            f"instance {instance_id} (pid {proc.pid}) exited ({code}) before serving; see its log"
        )
    log.info("instance %s (pid %d) serves at %s", instance_id, proc.pid, url)
    client = _client(url, spec)
    return InstanceHandle(
        id=instance_id,
        url=url,
        client=client,
        stop=lambda: _stop_process(proc),
        set_background=client.set_background,
    )


async def _stop_process(proc: asyncio.subprocess.Process, grace_s: float = 10.0) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        async with asyncio.timeout(grace_s):
            await proc.wait()
    except TimeoutError:
        log.warning("instance pid %d ignored SIGTERM for %g s; killing it", proc.pid, grace_s)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


@contextlib.asynccontextmanager
async def start_in_process(spec: InstanceSpec, count: int) -> AsyncIterator[list[InstanceHandle]]:
    """Start `count` `EngineServer`s in this process (tests); stop them all on exit."""
    from dora.engine.batcher import BatcherConfig
    from dora.engine.server import EngineServer

    config = BatcherConfig(max_running=spec.max_running, max_model_len=spec.max_model_len)
    async with contextlib.AsyncExitStack() as stack:
        handles: list[InstanceHandle] = []
        for i in range(count):
            # Each server's context is the handle that stops it: the stack exits them in reverse.
            server = await stack.enter_async_context(
                EngineServer.start(
                    Path(spec.model_dir),
                    host="127.0.0.1",
                    port=0,
                    version=0,
                    threads=spec.threads,
                    dtype=spec.dtype,
                    config=config,
                    control_token=spec.token or None,
                    stall_s=spec.stall_s,
                )
            )
            client = _client(server.url, spec)
            stack.push_async_callback(client.close)
            handles.append(
                InstanceHandle(id=f"i{i}", url=server.url, client=client, stop=_noop_stop)
            )
        yield handles


@contextlib.asynccontextmanager
async def attach(spec: InstanceSpec, urls: list[str]) -> AsyncIterator[list[InstanceHandle]]:
    """Use engines already running at `urls` (started by hand or on other nodes). They may hold
    any version, so each loads version 0 (`spec.model_dir`) first; they are not stopped on exit."""
    handles = [
        InstanceHandle(id=f"i{i}", url=url, client=_client(url, spec), stop=_noop_stop)
        for i, url in enumerate(urls)
    ]
    try:
        async with asyncio.TaskGroup() as tg:
            for h in handles:
                tg.create_task(
                    h.client.load_weights(0, path=spec.model_dir, timeout_s=spec.control_timeout_s)
                )
        yield handles
    finally:
        for h in handles:
            await h.client.close()


async def _noop_stop() -> None:
    """In-process servers are stopped by the exit of `start_in_process`'s context."""
