"""The plan a command starts from, and `--dry-run`: what `dora run`, `dora serve` and `dora learn`
would start, printed, with nothing started and nothing written.

`planned` loads the config, counts the GPUs this process sees (or takes `--gpus`), makes the GPU
plan (`dora.gpu_plan`) and reloads the config with the plan's settings pinned, so that every
process the command starts, re-planning from the same settings, gets the same plan. `dry_run`
prints the resolved config and, for each process, the `CUDA_VISIBLE_DEVICES` it would be started
with, its dtype, its ports, its weights and its command line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dora.config import DoraConfig, config_from_raw, load_config
from dora.config_file import raw_config
from dora.config_text import render_toml
from dora.cpu_plan import given_keys
from dora.errors import ConfigError
from dora.gpu_plan import GpuPlan, cpu_bf16_refusal, plan_gpus, visible_devices

__all__ = [
    "Planned",
    "count_gpus",
    "cpu_flags",
    "dry_run",
    "planned",
    "process_lines",
    "thread_overrides",
]


@dataclass(frozen=True)
class Planned:
    config: DoraConfig
    plan: GpuPlan
    overrides: list[str]
    """The command's overrides followed by the plan's pinned settings."""
    raw: dict[str, object]
    """The config as written: the file's sections with the command's overrides (not the plan's)."""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """This CPU's feature flags (x86 `flags`, Arm `Features`); None where there is no cpuinfo."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def count_gpus() -> int:
    """GPUs this process sees: 0 without an NVIDIA driver, else torch's count, asked in a child
    process so that this one has not touched CUDA yet and may still set the
    `CUDA_VISIBLE_DEVICES` of its own trainer (torch reads it once)."""
    if not (os.path.isdir("/proc/driver/nvidia") or shutil.which("nvidia-smi")):
        return 0
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def trainer_environment(plan: GpuPlan) -> dict[str, str]:
    """What `dora learn` sets in its environment before torch starts: the plan's GPUs for the
    trainer ('' hides every GPU from a trainer the plan keeps on the CPU); nothing without GPUs."""
    return {"CUDA_VISIBLE_DEVICES": plan.trainer_env()} if plan.on_gpu else {}


def planned(path: str | None, overrides: list[str], gpus: int | None = None) -> Planned:
    """The config of `path` with `overrides`, planned on `gpus` GPUs (None: those visible)."""
    raw = raw_config(path, overrides)
    config = config_from_raw(raw)
    count = count_gpus() if gpus is None else gpus
    env = os.environ if gpus is None else {}
    plan = plan_gpus(config, visible_devices(env, count), given_keys(raw, overrides))
    refusal = cpu_bf16_refusal(config, plan, cpu_flags())
    if refusal:
        raise ConfigError(refusal)
    pinned = [*overrides, *plan.overrides()]
    return Planned(config=load_config(path, pinned), plan=plan, overrides=pinned, raw=raw)


def process_lines(config: DoraConfig, plan: GpuPlan, *, weights: str) -> list[str]:
    """One line per process: its name, `CUDA_VISIBLE_DEVICES`, dtype, ports and weights."""
    serve = config.serve
    link = f"tcp://{serve.host}:{serve.port or '<free port at start>'}"
    layout = "colocated" if plan.colocated else "separate"
    head = (
        f"placement: {len(plan.visible)} GPU(s) visible ({','.join(plan.visible)}), {layout}"
        if plan.on_gpu
        else "placement: no GPU visible: every process on the CPU"
    )
    lines = [head, f"  dora serve         trainer link {link}; weights {weights}"]
    kind = {"vllm": "vllm", "embedded": "engine", "emulated": "emulated"}[serve.backend]
    for i, devices in enumerate(plan.instances):
        env = _env(plan, ",".join(devices))
        extra = ""
        if serve.backend == "vllm" and devices:
            eager = " --enforce-eager" if serve.enforce_eager else " cuda-graphs"
            extra = f" tp={len(devices)} mem={plan.memory_fraction:g}{eager}"
        elif serve.backend == "vllm":
            extra = " --enforce-eager (CPU build)"
        elif devices:
            extra = " on cuda"
        else:
            extra = f" threads={serve.threads_per_instance}"
        where = serve.urls[i] if serve.urls else "http://127.0.0.1:<free port at start>"
        lines.append(
            f"  {kind} i{i:<10} {env} dtype={config.model.dtype}{extra} at {where}; "
            f"weights {weights}"
        )
    ranks = plan.trainer_processes if plan.on_gpu else config.learn.processes
    device = "cuda" if plan.trainer else "cpu"
    lines.append(
        f"  dora learn         {_env(plan, plan.trainer_env())} ranks={ranks} on {device} "
        f"dtype={config.model.dtype} strategy={config.learn.strategy} "
        f"threads={config.learn.threads}; connects to {link}; "
        f"weights {weights}"
    )
    return lines


def _env(plan: GpuPlan, value: str) -> str:
    if not plan.on_gpu:
        return "CUDA_VISIBLE_DEVICES=(unchanged)"
    return f"CUDA_VISIBLE_DEVICES={value or '(none)'}"


def _weights(config: DoraConfig) -> str:
    """Where the initial weights come from, looked up without downloading or building."""
    from dora.models.hub import resolve_model_path
    from dora.models.prepare import cache_root, model_key

    model = config.model
    if model.path == "tiny" or model.warmup_steps:
        built = cache_root() / model_key(config)
        state = "cached" if (built / "config.json").is_file() else "built at start"
        return f"{built} ({state})"
    local = resolve_model_path(model.path, download=False)
    if local is None:
        return f"{model.path} (not in the Hugging Face cache: downloaded at start)"
    return str(local)


def dry_run(command: str, path: str, overrides: list[str], gpus: int | None) -> int:
    """Print what `dora COMMAND` would start; start nothing, write nothing."""
    if command == "run":
        raw = raw_config(path, overrides)
        overrides = [*overrides, *thread_overrides(raw, overrides, config_from_raw(raw))]
    plan = planned(path, overrides, gpus)
    print(f"# dora {command} --dry-run: the resolved config", flush=True)
    print(render_toml(plan.config), end="")
    print()
    for line in process_lines(plan.config, plan.plan, weights=_weights(plan.config)):
        print(line)
    print(f"dora {command}: dry run, nothing started", flush=True)
    return 0


def thread_overrides(raw: dict[str, object], overrides: list[str], config: DoraConfig) -> list[str]:
    """Threads per instance and trainer threads for this mode on this machine, where the config
    as written (`raw_config`) and its overrides leave them unset."""
    from dora.cpu_plan import run_threads

    return run_threads(
        config.rollout.mode,
        len(os.sched_getaffinity(0)),
        instances=config.serve.instances,
        given=given_keys(raw, overrides),
    )
