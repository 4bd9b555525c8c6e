"""The named setups of the cost model, as plain data: `dora simulate --preset`, `emulate.preset`.

`paper-64` / `paper-128`: Qwen2.5-32B on 64 / 128 H800, DAPO-Math (the paper's §5.1).
`agentic`: multi-turn tool-using episodes (tau2-like: about 8 turns, seconds of tool latency,
short turns over a long context), for the scale runs; not a paper number.
`cpu-bench`: `dora bench modes examples/math/bench.toml --placement split` on a 2-core machine,
its constants measured there by `python -m dora.bench.cpu` (docs/simulator.md has the run); a
test keeps them equal to what `dora.bench.cpu_costs.setup_for` derives from the stored
measurement, so a new measurement is pasted here from its output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dora.costs.model import Setup
from dora.errors import ConfigError

__all__ = ["CPU_BENCH_LENGTHS", "PRESETS", "preset"]

CPU_BENCH_LENGTHS = Path(__file__).with_name("cpu_bench_lengths.txt")
"""The response lengths of the groups sampled in the `cpu-bench` measurement, one group a line."""

_PAPER_64 = Setup()

PRESETS: dict[str, Setup] = {
    "paper-64": _PAPER_64,
    "paper-128": dataclasses.replace(_PAPER_64, name="paper-128", gpus=128, rollout_gpus=64),
    "agentic": dataclasses.replace(
        _PAPER_64,
        name="agentic",
        gpus=2048,
        rollout_gpus=1024,
        groups_per_step=512,
        group_size=8,
        steps=6,
        warmup_steps=2,
        prompt_median=1500,
        response_median=350,
        response_sigma=1.0,
        response_max=8192,
        turns=6.0,
        tool_latency_s=4.0,
        tool_tokens=400,
        max_seqs=64,
    ),
    "cpu-bench": dataclasses.replace(
        _PAPER_64,
        name="cpu-bench",
        gpus=2,
        groups_per_step=4,
        group_size=8,
        steps=20,
        warmup_steps=1,
        prompt_median=94,
        prompt_sigma=0.09073789412504636,
        prompt_max=166,
        response_median=19,
        response_sigma=0.6385161806764883,
        response_max=512,
        group_share=0.6494899126132465,
        lengths_file=str(CPU_BENCH_LENGTHS),
        params_b=0.000538624,
        layers=2,
        hidden=128,
        kv_heads=4,
        head_dim=32,
        gpu_mem_gb=0.051408896,
        hbm_tbps=0.009061978020696665,
        gpu_tflops=1.0,
        hbm_efficiency=1.0,
        decode_mfu=0.014901006504554644,
        prefill_mfu=0.05633762197484666,
        mem_utilization=1.0,
        activation_gb=0.0,
        gpus_per_instance=1,
        rollout_gpus=1,
        max_seqs=64,
        kv_watermark=0.0,
        weight_sync_s=0.0016610029997536913,
        kv_transfer_gbps=1.0,
        partial_colocated=False,
        pool_instances=4,
        shared_cores=True,
        train_parallel_efficiency=0.08271929547409229,
        decode_overhead_ms=0.8016863180490367,
        train_gpu_s_per_token=8.857245849186017e-05,
        train_step_overhead_s=0.0,
    ),
}


def preset(name: str) -> Setup:
    """The preset called `name`; ConfigError naming the others when there is none."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}"
        ) from None
