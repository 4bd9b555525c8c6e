"""The CPU calibration's data: what `python -m dora.bench.cpu` measured (`Costs`), the fits it
makes, and the cost model's `Setup` derived from them (`setup_for`).

The prediction is of the split placement (`dora bench modes --placement split`), because the cost
model gives rollout and training disjoint pools; the benchmark's default for the asynchronous modes
is `shared` (dora/cpu_plan.py: serve, its instances and the trainer unpinned on every core at
once), which the model does not represent. On the cost model a GPU is a core: `gpus` = the cores
the measuring process may use, `rollout_gpus` = the cores the split placement pins serve to (the
rest train), `gpus_per_instance` = threads per instance, `pool_instances` = `serve.instances`,
and `shared_cores` on (the instances are processes time-slicing their cores). The decode
coefficients are mapped onto the model's formulas (weight read and KV read at the fitted
bandwidth, `decode_overhead_ms` the rest of `t0`). The simulator counts prompt and response tokens
as trained tokens; the benchmark counts loss (response) tokens only, so compare ratios, not
tokens/s.

`BENCH_COSTS` is the measurement behind the `cpu-bench` preset of `dora.costs.presets`, which
stores the `Setup` it gives as plain data; a test keeps the two equal. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dora.config import DoraConfig
from dora.costs import Setup, validate

__all__ = [
    "BENCH_COSTS",
    "BENCH_SETTINGS",
    "Costs",
    "fit_decode",
    "fit_linear",
    "group_share",
    "lognormal",
    "one_core_serve",
    "overrides",
    "setup_for",
    "write_lengths",
]

_NOMINAL_TFLOPS = 1.0  # the cost model's unit of compute; the fitted efficiencies absorb it


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What was measured (seconds unless named otherwise)."""

    decode_t0_s: float
    decode_c_s: float
    decode_k_s: float
    prefill_s_per_token: float
    train_s_per_token: float
    """One thread."""
    train_step_s: float
    train_speedup: float
    """Training at every core over one thread."""
    weight_sync_s: float
    prompt_median: float
    prompt_sigma: float
    prompt_max: int
    response_median: float
    response_sigma: float
    group_share: float
    response_mean: float
    response_max: int
    params: int
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    cores: int


def fit_linear(x: list[list[float]], y: list[float]) -> list[float]:
    """Least-squares coefficients of `y ~ x` (rows of regressors), negatives clipped to 0."""
    coef, *_ = np.linalg.lstsq(np.asarray(x, dtype=float), np.asarray(y, dtype=float), rcond=None)
    return [max(0.0, float(v)) for v in coef]


def fit_decode(samples: list[tuple[int, float, float]]) -> tuple[float, float, float]:
    """`(t0, c, k)` of `t = t0 + c*b + k*S` from `(b, S, seconds)` samples."""
    t0, c, k = fit_linear([[1.0, b, s] for b, s, _ in samples], [t for _, _, t in samples])
    return t0, c, k


def lognormal(values: list[float]) -> tuple[float, float]:
    logs = [math.log(max(1.0, v)) for v in values]
    return math.exp(statistics.median(logs)), statistics.pstdev(logs)


def group_share(groups: list[list[int]]) -> float:
    """Share of the variance of log-lengths that lies between groups (one-way decomposition)."""
    logs = [[math.log(max(1, n)) for n in g] for g in groups if len(g) > 1]
    every = [v for g in logs for v in g]
    total = statistics.pvariance(every)
    within = statistics.fmean(statistics.pvariance(g) for g in logs)
    return 0.0 if total <= 0 else min(1.0, max(0.0, 1.0 - within / total))


def write_lengths(path: Path, groups: list[tuple[int, list[int]]]) -> Path:
    """A lengths file of the sampled groups, one group's response lengths per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# response lengths of one group per line (python -m dora.bench.cpu)"]
    lines += [" ".join(map(str, g)) for _, g in groups]
    path.write_text("\n".join(lines) + "\n")
    return path


def one_core_serve(costs: Costs, groups: list[tuple[int, list[int]]], *, max_running: int) -> float:
    """Seconds per response token when one engine on one core decodes every group: all queued at
    once, continuous batching over `max_running` rows, each step costing the fitted
    `t0 + c*b + k*S` and each admitted prompt its prefill (pure)."""
    waiting = [(p, n) for p, g in groups for n in g]
    waiting.reverse()
    running: list[list[int]] = []  # [tokens left, context]
    seconds = 0.0
    tokens = 0
    while waiting or running:
        while waiting and len(running) < max_running:
            prompt, n = waiting.pop()
            seconds += prompt * costs.prefill_s_per_token
            running.append([n, prompt])
        b = len(running)
        seconds += costs.decode_t0_s + costs.decode_c_s * b
        seconds += costs.decode_k_s * sum(ctx for _, ctx in running)
        tokens += b
        for row in running:
            row[0] -= 1
            row[1] += 1
        running = [row for row in running if row[0] > 0]
    return seconds / max(1, tokens)


def setup_for(
    config: DoraConfig,
    costs: Costs,
    *,
    trainer_cores: int | None = None,
    lengths_file: str | Path = "",
) -> Setup:
    """The cost model of `dora bench modes CONFIG --placement split` on this machine (see the
    module docstring); `lengths_file` (from `write_lengths`) gives the measured groups' response
    lengths."""
    serve_cores = costs.cores - (trainer_cores or max(1, costs.cores // 2))
    tp = config.serve.threads_per_instance
    params_b = costs.params / 1e9
    kv_bytes = 2.0 * costs.layers * costs.kv_heads * costs.head_dim * 2.0  # the model's formula
    bandwidth = kv_bytes / tp / costs.decode_k_s if costs.decode_k_s > 0 else 1e15
    weight_read_s = params_b * 2e9 / tp / bandwidth
    c = max(costs.decode_c_s, 1e-9)
    kv_tokens = config.serve.max_running * config.model.max_model_len
    weights_gb = params_b * 2.0 / tp
    r, learn = config.rollout, config.learn
    prompt = max(1, round(costs.prompt_median))  # prefill matches the measurement at this length
    prefill_flops = 2.0 * params_b * 1e9 * prompt + 2.0 * costs.layers * costs.hidden * prompt**2
    setup = Setup(
        name="cpu-bench",
        gpus=costs.cores,
        groups_per_step=r.batch_size,
        group_size=r.group_size,
        staleness=r.staleness,
        steps=learn.steps,
        warmup_steps=1,  # the benchmark's window starts at the first trained step
        prompt_median=prompt,
        prompt_sigma=costs.prompt_sigma,
        prompt_max=costs.prompt_max,
        response_median=max(1, round(costs.response_median)),
        response_sigma=costs.response_sigma,
        response_max=costs.response_max,
        group_share=costs.group_share,
        params_b=params_b,
        layers=costs.layers,
        hidden=costs.hidden,
        kv_heads=costs.kv_heads,
        head_dim=costs.head_dim,
        gpu_mem_gb=weights_gb + kv_tokens * kv_bytes / 1e9 / tp,
        hbm_tbps=bandwidth / 1e12,
        gpu_tflops=_NOMINAL_TFLOPS,
        hbm_efficiency=1.0,
        decode_mfu=2.0 * params_b * 1e9 / tp / (c * _NOMINAL_TFLOPS * 1e12),
        prefill_mfu=prefill_flops / (tp * prompt * costs.prefill_s_per_token * 1e12),
        mem_utilization=1.0,
        activation_gb=0.0,
        gpus_per_instance=tp,
        rollout_gpus=serve_cores,
        max_seqs=config.serve.max_running,
        kv_watermark=0.0,
        weight_sync_s=costs.weight_sync_s,
        kv_transfer_gbps=1.0,
        migrate_kv=config.serve.kv_migration,
        partial_colocated=False,  # as `--placement split` runs partial, and dora
        pool_instances=config.serve.instances,
        shared_cores=True,
        train_parallel_efficiency=min(1.0, max(0.0, (costs.train_speedup - 1) / (costs.cores - 1))),
        decode_overhead_ms=1e3 * max(0.0, costs.decode_t0_s - weight_read_s),
        train_gpu_s_per_token=costs.train_s_per_token,
        train_step_overhead_s=costs.train_step_s,
        lengths_file=str(lengths_file),
    )
    validate(setup)
    return setup


BENCH_SETTINGS = (
    "model.max_model_len=768",
    "serve.instances=4",
    "serve.max_running=64",
    "rollout.staleness=3",
    "rollout.group_size=8",
    "rollout.batch_size=4",
    "rollout.max_tokens=512",
    "learn.steps=20",
)
"""The settings of examples/math/bench.toml that shape the cost model (a test keeps them equal)."""

BENCH_COSTS = Costs(
    decode_t0_s=0.0009205619098392255,
    decode_c_s=7.229364000819194e-05,
    decode_k_s=1.1299961196786009e-07,
    prefill_s_per_token=1.997556802277619e-05,
    train_s_per_token=8.857245849186017e-05,
    train_step_s=0.0,
    train_speedup=1.0827192954740923,
    weight_sync_s=0.0016610029997536913,
    prompt_median=94.0,
    prompt_sigma=0.09073789412504636,
    prompt_max=166,
    response_median=18.999999999999996,
    response_sigma=0.6385161806764883,
    group_share=0.6494899126132465,
    response_mean=36.692057291666664,
    response_max=512,
    params=538624,
    layers=2,
    hidden=128,
    kv_heads=4,
    head_dim=32,
    cores=2,
)
"""`python -m dora.bench.cpu examples/math/bench.toml` on the 2-core machine at load average 1.5-2.5
(docs/simulator.md has the run and its numbers)."""


def overrides(setup: Setup, base: Setup) -> list[str]:
    """`key=value` for every field of `setup` that differs from `base`."""
    out = []
    for f in dataclasses.fields(Setup):
        value = getattr(setup, f.name)
        if f.name != "name" and value != getattr(base, f.name):
            out.append(f"{f.name}={value:.6g}" if isinstance(value, float) else f"{f.name}={value}")
    return out
