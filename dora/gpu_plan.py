"""Which GPUs each process of a run gets: the inference instances, with tensor parallelism, and
the trainer's ranks, side by side or colocated.

A device is named as `CUDA_VISIBLE_DEVICES` names it: an id from the GPUs this process sees (the
entries of its own `CUDA_VISIBLE_DEVICES`, else `0..N-1`). Every process dora starts gets
`CUDA_VISIBLE_DEVICES` set to its own ids, so the plan holds whatever the parent was given.

With nothing said, `plan_gpus` fills the visible GPUs:

- separate (the default): `serve.instances` instances of `serve.vllm_tensor_parallel` GPUs each
  take the first GPUs (when `serve.instances` is not set: half the GPUs' worth of instances), and
  the trainer takes every GPU left, one rank each (`learn.processes` when it is set);
- colocated (`run.colocate`): the instances as above, and the trainer on every GPU, sharing them
  (vLLM's memory fraction then defaults to `COLOCATED_MEMORY_FRACTION`).

`serve.vllm_devices` (one entry per instance) and `learn.devices` override the planned devices;
`serve.instances` and `learn.processes` override the counts. A plan that cannot hold (more
GPUs asked than visible, a device that does not exist, instances sharing a GPU, a trainer on an
instance's GPU without colocation, an entry whose size is not the tensor-parallel size) raises
`ConfigError` naming the keys to change, before anything starts.

Instances that dora starts run on GPUs, vLLM servers and embedded engines alike; an embedded
engine spans one GPU (it has no tensor parallelism). Emulated instances and servers attached at
`serve.urls` take none of this machine's GPUs. With no GPU visible the plan is the CPU plan:
every process on the CPU, as `dora.cpu_plan` threads it. The module is pure: the GPU count and
the visible ids are arguments.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from dora.config import DoraConfig
from dora.errors import ConfigError

__all__ = [
    "BF16_CPU_FLAGS",
    "COLOCATED_MEMORY_FRACTION",
    "PINNED",
    "GpuPlan",
    "cpu_bf16_refusal",
    "plan_gpus",
    "visible_devices",
]

PINNED = frozenset({"serve.instances", "learn.processes"})
"""The keys to pass as `given` for a config whose counts stand as they are (nothing planned)."""

COLOCATED_MEMORY_FRACTION = 0.45
"""vLLM's share of each GPU's memory when the trainer shares it and the config does not say."""


@dataclass(frozen=True, kw_only=True)
class GpuPlan:
    """Where the instances and the trainer's ranks run; an empty tuple is the CPU."""

    visible: tuple[str, ...]
    """The GPU ids this process sees, in order."""
    backend: str
    instances: tuple[tuple[str, ...], ...]
    """Each instance's GPUs (its tensor-parallel group)."""
    trainer: tuple[str, ...]
    """The trainer's GPUs, one rank each."""
    colocated: bool
    memory_fraction: float
    """vLLM's `--gpu-memory-utilization`."""

    @property
    def on_gpu(self) -> bool:
        return bool(self.visible)

    @property
    def trainer_processes(self) -> int:
        """Ranks the trainer starts (at least 1: a CPU trainer has one unless told more)."""
        return max(1, len(self.trainer))

    def instance_env(self, index: int) -> str:
        """`CUDA_VISIBLE_DEVICES` of instance `index` ('' hides every GPU)."""
        return ",".join(self.instances[index])

    def trainer_env(self) -> str:
        """`CUDA_VISIBLE_DEVICES` of the trainer ('' hides every GPU)."""
        return ",".join(self.trainer)

    def overrides(self) -> list[str]:
        """The settings that pin this plan, for the processes `dora run` starts: each re-plans
        from them and gets the same plan."""
        out = [f"serve.instances={len(self.instances)}"]
        if not self.on_gpu:
            return out
        out.append(f"learn.processes={self.trainer_processes}")
        out.append(f"learn.devices={self.trainer_env()!r}")
        if any(self.instances):
            entries = ", ".join(repr(self.instance_env(i)) for i in range(len(self.instances)))
            out.append(f"serve.vllm_devices=[{entries}]")
        return out


def visible_devices(env: Mapping[str, str], count: int) -> tuple[str, ...]:
    """The GPU ids a process sees: its `CUDA_VISIBLE_DEVICES` entries when set, else `0..count-1`.
    `count` is what the driver reports (or `--gpus`); a longer list is cut to it."""
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is None:
        return tuple(str(i) for i in range(count))
    ids = tuple(part.strip() for part in given.split(",") if part.strip())
    return ids[:count] if count < len(ids) else ids


def plan_gpus(config: DoraConfig, visible: Sequence[str], given: Collection[str]) -> GpuPlan:
    """The plan for `config` on the GPUs `visible`; `given` holds the dotted keys the user set
    (the rest are planned). Raises `ConfigError` naming the keys when it cannot hold."""
    serve, learn = config.serve, config.learn
    visible = tuple(visible)
    colocated = config.run.colocate
    fraction = serve.gpu_memory_fraction
    if colocated and "serve.gpu_memory_fraction" not in given:
        fraction = COLOCATED_MEMORY_FRACTION
    if not visible:
        named = [
            key
            for key, value in (
                ("serve.vllm_devices", serve.vllm_devices),
                ("learn.devices", learn.devices),
            )
            if value
        ]
        if learn.weight_transport == "nccl":
            raise ConfigError(
                "learn.weight_transport = 'nccl' broadcasts from trainer rank 0's GPU to the vLLM "
                "instances' GPUs, but no GPU is visible (CUDA_VISIBLE_DEVICES, or --gpus with "
                "--dry-run): use learn.weight_transport = 'inline' on the CPU"
            )
        if named:
            raise ConfigError(
                f"{' and '.join(named)} name GPUs, but none is visible (CUDA_VISIBLE_DEVICES, or "
                "--gpus with --dry-run): leave them empty to run on the CPU"
            )
        return GpuPlan(
            visible=(),
            backend=serve.backend,
            instances=((),) * serve.instances,
            trainer=(),
            colocated=colocated,
            memory_fraction=fraction,
        )
    on_gpus = serve.backend in ("vllm", "embedded") and not serve.urls
    if on_gpus and serve.backend == "embedded" and serve.vllm_tensor_parallel != 1:
        raise ConfigError(
            f"serve.vllm_tensor_parallel = {serve.vllm_tensor_parallel}, but an embedded engine "
            "runs on one GPU: set serve.vllm_tensor_parallel = 1, or serve.backend = 'vllm'"
        )
    instances = _instance_devices(config, visible, given) if on_gpus else _cpu_instances(config)
    trainer = _trainer_devices(config, visible, given, instances)
    return GpuPlan(
        visible=visible,
        backend=serve.backend,
        instances=instances,
        trainer=trainer,
        colocated=colocated,
        memory_fraction=fraction,
    )


BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""CPU feature flags (`/proc/cpuinfo`: x86's AVX-512 BF16 and AMX, Arm's BF16) of native
bfloat16 arithmetic. Without one, torch emulates it many times slower than float32."""


def cpu_bf16_refusal(config: DoraConfig, plan: GpuPlan, flags: frozenset[str] | None) -> str | None:
    """The error for `model.dtype = "bfloat16"` computed on a CPU without native bfloat16, or
    None. `flags` are the CPU's feature flags; None: unknown (not Linux), never refused."""
    if config.model.dtype != "bfloat16" or flags is None or flags & BF16_CPU_FLAGS:
        return None
    on_cpu = []
    serve = config.serve
    if serve.backend != "emulated" and not serve.urls and not any(plan.instances):
        on_cpu.append("the inference instances")
    if not plan.trainer and not config.emulate.trainer:
        on_cpu.append("the trainer")
    if not on_cpu:
        return None
    return (
        f"model.dtype = 'bfloat16', but {' and '.join(on_cpu)} would run on this CPU, which has "
        "no native bfloat16 (no avx512_bf16, amx_bf16 or bf16 flag): set model.dtype = "
        "'float32', or run them on GPUs"
    )


def _cpu_instances(config: DoraConfig) -> tuple[tuple[str, ...], ...]:
    if config.serve.vllm_devices:
        raise ConfigError(
            f"serve.vllm_devices is set but the instances are {_where(config)}: they take no GPU "
            "of this machine; leave it empty"
        )
    n = len(config.serve.urls) or config.serve.instances
    return ((),) * n


def _where(config: DoraConfig) -> str:
    if config.serve.urls:
        return "attached (serve.urls)"
    return f"{config.serve.backend} (serve.backend)"


def _instance_devices(
    config: DoraConfig, visible: tuple[str, ...], given: Collection[str]
) -> tuple[tuple[str, ...], ...]:
    serve = config.serve
    tp = serve.vllm_tensor_parallel
    trainer_need = 0 if config.run.colocate else _trainer_need(config, given)
    if serve.vllm_devices:
        count = len(serve.vllm_devices)
    elif "serve.instances" in given:
        count = serve.instances
    else:
        room = len(visible) - trainer_need
        count = max(1, min(len(visible) // 2 if trainer_need else len(visible), room) // tp)
    _check_fits(config, count, trainer_need, len(visible))
    for i, entry in enumerate(serve.vllm_devices):
        size = len(entry.split(","))
        if size != tp:
            raise ConfigError(
                f"serve.vllm_devices[{i}] = {entry!r} holds {size} GPU(s) but "
                f"serve.vllm_tensor_parallel = {tp}: each entry needs as many GPUs as the "
                "tensor-parallel size"
            )
    if not serve.vllm_devices:
        return tuple(tuple(visible[i * tp : (i + 1) * tp]) for i in range(count))
    groups = tuple(
        _ids(entry, f"serve.vllm_devices[{i}]", visible)
        for i, entry in enumerate(serve.vllm_devices)
    )
    if "serve.instances" in given and count != serve.instances:
        raise ConfigError(
            f"serve.vllm_devices has {count} entries but serve.instances = "
            f"{serve.instances}: give one entry (one CUDA_VISIBLE_DEVICES) per instance"
        )
    _disjoint(groups, "serve.vllm_devices")
    return groups


def _check_fits(config: DoraConfig, count: int, trainer_need: int, gpus: int) -> None:
    """Refuse more GPUs than there are, naming every key that sets the count."""
    tp = config.serve.vllm_tensor_parallel
    need = count * tp + trainer_need
    if need <= gpus:
        return
    keys = (
        "serve.instances (or the entries of serve.vllm_devices)"
        if config.serve.vllm_devices
        else "serve.instances"
    )
    trainer_key = "learn.devices" if config.learn.devices else "learn.processes"
    trainer_part = f" + {trainer_need} for the trainer ({trainer_key})" if trainer_need else ""
    raise ConfigError(
        f"{count} instance(s) x serve.vllm_tensor_parallel = {tp} GPUs{trainer_part} need "
        f"{need} GPUs, but {gpus} are visible: lower {keys} or serve.vllm_tensor_parallel"
        + ("" if config.run.colocate else ", or set run.colocate = true to share them")
    )


def _trainer_need(config: DoraConfig, given: Collection[str]) -> int:
    if config.learn.devices:
        return len(config.learn.devices.split(","))
    return config.learn.processes if "learn.processes" in given else 1


def _trainer_devices(
    config: DoraConfig,
    visible: tuple[str, ...],
    given: Collection[str],
    instances: tuple[tuple[str, ...], ...],
) -> tuple[str, ...]:
    learn = config.learn
    if config.emulate.trainer:
        return ()  # it spends modelled time and computes nothing
    used = {gpu for group in instances for gpu in group}
    if learn.devices:
        devices = _ids(learn.devices, "learn.devices", visible)
        _disjoint(tuple((d,) for d in devices), "learn.devices")
        shared = sorted(used & set(devices))
        if shared and not config.run.colocate:
            raise ConfigError(
                f"learn.devices = {learn.devices!r} shares GPU(s) {','.join(shared)} with the "
                "instances (serve.vllm_devices): give the trainer other GPUs, or set "
                "run.colocate = true to share them"
            )
    else:
        free = visible if config.run.colocate else tuple(g for g in visible if g not in used)
        devices = free[: learn.processes] if "learn.processes" in given else free
    if "learn.processes" in given and learn.processes != len(devices):
        raise ConfigError(
            f"learn.processes = {learn.processes} ranks but the trainer has {len(devices)} "
            f"GPU(s) ({','.join(devices)}): each rank takes one GPU; set learn.processes to "
            f"{len(devices)}, or learn.devices to {learn.processes} GPUs"
        )
    return devices


def _ids(entry: str, key: str, visible: tuple[str, ...]) -> tuple[str, ...]:
    ids = tuple(part.strip() for part in entry.split(","))
    if not all(ids):
        raise ConfigError(f"{key} = {entry!r} is not a comma-separated list of GPU ids")
    for gpu in ids:
        if gpu not in visible:
            raise ConfigError(
                f"{key} = {entry!r} names GPU {gpu}, which does not exist here: the visible "
                f"GPUs are {','.join(visible)}"
            )
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{key} = {entry!r} names a GPU twice")
    return ids


def _disjoint(groups: tuple[tuple[str, ...], ...], key: str) -> None:
    seen: dict[str, int] = {}
    for i, group in enumerate(groups):
        for gpu in group:
            if gpu in seen:
                raise ConfigError(
                    f"{key}: GPU {gpu} is in entries {seen[gpu]} and {i}; instances need "
                    "disjoint GPUs"
                )
            seen[gpu] = i
