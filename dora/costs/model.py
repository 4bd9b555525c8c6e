"""The cost model of a cluster: every constant of a `Setup`, with where it came from, and the
formulas of decode, prefill and training time that the simulator, the emulated instances and the
emulated trainer all spend.

A `Setup` is flat on purpose: every field can be overridden on the command line as `key=value`,
and docs/simulator.md lists each one with its source. Three kinds of constants:

- *given*: the paper's setup (GPUs, batch, group size, K, length limits) or a public hardware or
  model spec (H800 memory and bandwidth, Qwen2.5-32B's shape);
- *assumed*: an engineering choice the paper does not state (tensor parallelism, the disaggregated
  split, weight-sync time); each one is in the sensitivity table of docs/simulator.md;
- *calibrated*: fitted on the paper's synchronous baseline only (`decode_overhead_ms` on the sync
  rollout time at 64 GPUs, `train_gpu_s_per_token` and `train_step_overhead_s` on the sync
  training time at 64 and 128 GPUs). Nothing is fitted on another mode.

Decode is memory-bound: one step of an instance running `b` sequences holding `S` context tokens
in all takes `t = t0 + c * b + k * S` seconds, where `t0` reads the weights once (plus the per-step
overhead: kernel launches, tensor-parallel all-reduces, the scheduler), `c` is the per-sequence
compute and `k` reads one token's KV cache. Prefill is compute-bound.

Between events a batch's size `b` is fixed and `S` grows by `b` tokens per step, so the time to
advance every running sequence by `p` tokens is the integral `(t0 + c*b + k*S) * p + k*b*p^2/2`
(`decode_seconds`); `decode_steps` inverts it. The simulator and the emulated instances both move
their batches with these two, so a modelled second means the same in both.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass

from dora.errors import ConfigError

__all__ = ["Setup", "apply_overrides", "decode_seconds", "decode_steps", "validate"]


@dataclass(frozen=True, slots=True)
class Setup:
    """One simulated cluster, model, workload and rollout policy."""

    name: str = "paper-64"
    # --- the paper's setup (given) -----------------------------------------------------------
    gpus: int = 64
    """Accelerators in all (paper: 64 or 128 H800)."""
    groups_per_step: int = 512
    """B: prompts per train step (paper: 512)."""
    group_size: int = 16
    """G: samples per prompt (paper: 16)."""
    staleness: int = 3
    """K of the multi-version modes (paper: k = 3). one_step_off uses 1, sync 0."""
    steps: int = 24
    """Train steps simulated."""
    warmup_steps: int = 6
    """Steps left out of the averages (the paper averages 5 iterations after warm-up)."""
    # --- workload (given: DAPO-Math-17k at the paper's checkpoint) -----------------------------
    prompt_median: int = 150
    """Median prompt tokens (DAPO-Math prompts with the template; assumed)."""
    prompt_sigma: float = 0.5
    """Log-normal sigma of prompt lengths (assumed)."""
    prompt_max: int = 2048
    """Maximum prompt tokens (paper: 2K)."""
    response_median: int = 1150
    """Median response tokens: max / median = 28 (paper's appendix C.3)."""
    response_sigma: float = 1.18
    """Log-normal sigma: gives mean about 2.2K response + 0.2K prompt = 2.4K tokens (paper)."""
    response_max: int = 30720
    """Maximum response tokens (paper: 30K)."""
    group_share: float = 0.5
    """Share of the log-length variance common to a prompt's samples (assumed; the paper's
    appendix C says hard prompts give long samples)."""
    lengths_file: str = ""
    """A file of real response lengths, drawn instead of the log-normal: one length per line (a
    pool, drawn length by length), or one measured group's lengths per line (drawn whole)."""
    # --- agentic episodes (0 turns-extra: single-turn math) ----------------------------------
    turns: float = 1.0
    """Mean turns per episode; 1 means single-turn. Turns beyond the first are geometric."""
    tool_latency_s: float = 0.0
    """Mean tool / environment latency between turns (exponential)."""
    tool_tokens: int = 0
    """Tokens the environment appends per turn (prefilled on return)."""
    context_max: int = 65536
    """An episode ends once its context reaches this (the 2601 report trains agents at 48K-64K
    contexts); single-turn math never reaches it."""
    # --- model and hardware (given: Qwen2.5-32B config, H800 spec) -----------------------------
    params_b: float = 32.8
    """Model parameters, billions (Qwen2.5-32B)."""
    layers: int = 64
    hidden: int = 5120
    kv_heads: int = 8
    head_dim: int = 128
    gpu_mem_gb: float = 80.0
    """H800 memory."""
    hbm_tbps: float = 3.35
    """H800 HBM bandwidth, TB/s."""
    gpu_tflops: float = 989.0
    """H800 dense bf16 TFLOP/s."""
    hbm_efficiency: float = 0.7
    """Achieved share of HBM bandwidth in decode (assumed; typical for vLLM)."""
    decode_mfu: float = 0.5
    """Achieved share of peak FLOP/s for the per-sequence decode compute (assumed)."""
    prefill_mfu: float = 0.5
    """Achieved share of peak FLOP/s in prefill (assumed)."""
    mem_utilization: float = 0.9
    """vLLM's gpu_memory_utilization (its default)."""
    activation_gb: float = 4.0
    """Per-GPU memory for activations and CUDA graphs (assumed)."""
    # --- inference deployment (assumed) ------------------------------------------------------
    gpus_per_instance: int = 4
    """Tensor parallelism of one instance (assumed: TP4 leaves room for 30K contexts)."""
    rollout_gpus: int = 32
    """Disaggregated modes: GPUs that generate; the rest train (assumed: half and half)."""
    max_seqs: int = 256
    """Running sequences per instance (vLLM's max_num_seqs default); also the slots the
    orchestrator counts."""
    controller_instances: int = 65536
    """Instances per orchestrator: a larger pool is split into controllers of this size, each
    with its own orchestrator (the production system's RolloutControllers, 2601 report §3.2).
    Groups go to any controller with room; the transfer queue stays global. By default every
    pool has one orchestrator (its planning costs about O(log n) per event)."""
    kv_watermark: float = 0.01
    """Free KV share kept before admitting a waiting sequence (vLLM's default)."""
    weight_sync_s: float = 5.0
    """Time to load a new version on an instance (assumed: layer-wise P2P / reshard of 65 GB;
    the paper's load-balancing overhead, 0.4% of time at 64 GPUs, is about 4 s per step)."""
    kv_transfer_gbps: float = 100.0
    """Effective GB/s of a KV-cache migration between instances (assumed, 8x400 Gb/s NICs)."""
    migrate_kv: bool = True
    """Migrations carry the KV cache (dora's zero-re-prefill); off: re-prefill on arrival."""
    partial_colocated: bool = True
    """Partial rollout runs colocated, as the paper ran it (Kimi-style)."""
    stream_training: bool = True
    """Disaggregated trainers start on groups as they arrive (dora's trainer; every disaggregated
    mode gets it, so that no baseline is weakened). Off: a step starts once it is full."""
    # --- CPU machines (off for the GPU presets) -------------------------------------------------
    pool_instances: int = 0
    """Instances in each pool whatever its size (CPU: instances are processes that share cores,
    so their number is not `gpus // gpus_per_instance`); 0 derives it from the GPUs."""
    shared_cores: bool = False
    """The instances of a pool share its cores (`gpus` colocated, `rollout_gpus` disaggregated),
    each using `gpus_per_instance` of them: while `n` instances are busy, a decode or prefill
    step takes `max(1, n * gpus_per_instance / cores)` times longer (time-sliced processes). Off:
    every instance has its own accelerators, as on a GPU cluster."""
    train_parallel_efficiency: float = 1.0
    """Share of a linear speed-up the trainer gets from each GPU (or core) beyond the first:
    time = tokens * train_gpu_s_per_token / (1 + (gpus - 1) * efficiency). 1 on GPUs (the
    paper's calibration assumes linear scaling); measured on a CPU."""
    # --- calibrated on the paper's synchronous baseline only ----------------------------------
    decode_overhead_ms: float = 13.0
    """Per-step decode overhead beyond the weight read (calibrated: sync rollout 14.9 min at 64
    GPUs)."""
    train_gpu_s_per_token: float = 1.013e-3
    """Trainer GPU-seconds per trained token, prompt and response (calibrated: sync training
    8.0 min at 64 GPUs and 5.5 min at 128; about 33% MFU for fwd+bwd+logprob recompute)."""
    train_step_overhead_s: float = 168.0
    """Per-step training time that does not shrink with GPUs (calibrated with the above)."""

    # --- derived quantities --------------------------------------------------------------------

    @property
    def instances(self) -> int:
        """Instances that generate in the disaggregated modes."""
        return self.pool_instances or max(1, self.rollout_gpus // self.gpus_per_instance)

    @property
    def colocated_instances(self) -> int:
        return self.pool_instances or max(1, self.gpus // self.gpus_per_instance)

    @property
    def train_gpus(self) -> int:
        return self.gpus - self.rollout_gpus

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2.0  # K and V, bf16

    @property
    def kv_capacity_tokens(self) -> float:
        """KV tokens one instance holds: memory left after weights and activations."""
        weights_gb = self.params_b * 2.0 / self.gpus_per_instance
        free_gb = self.gpu_mem_gb * self.mem_utilization - weights_gb - self.activation_gb
        if free_gb <= 0:
            raise ConfigError(
                f"{self.name}: the weights do not fit in {self.gpus_per_instance} GPUs"
            )
        return free_gb * 1e9 * self.gpus_per_instance / self.kv_bytes_per_token

    def decode_coefficients(self) -> tuple[float, float, float]:
        """`(t0, c, k)` of `step_time = t0 + c * b + k * S`, seconds."""
        bw = self.hbm_tbps * 1e12 * self.hbm_efficiency
        tp = self.gpus_per_instance
        t0 = self.params_b * 2e9 / tp / bw + self.decode_overhead_ms / 1e3
        c = 2.0 * self.params_b * 1e9 / tp / (self.gpu_tflops * 1e12 * self.decode_mfu)
        k = self.kv_bytes_per_token / tp / bw
        return t0, c, k

    def prefill_s(self, start: float, tokens: float) -> float:
        """Time to prefill `tokens` tokens after `start` tokens already in the cache: the
        linear layers plus attention, which grows with the context."""
        if tokens <= 0:
            return 0.0
        flops = 2.0 * self.params_b * 1e9 * tokens
        end = start + tokens
        flops += 2.0 * self.layers * self.hidden * (end * end - start * start)
        return flops / (self.gpus_per_instance * self.gpu_tflops * 1e12 * self.prefill_mfu)

    def train_s(self, tokens: float, gpus: int) -> float:
        """Per-token training time of `tokens` on `gpus` GPUs (without the step overhead)."""
        speedup = 1.0 + (max(1, gpus) - 1) * self.train_parallel_efficiency
        return tokens * self.train_gpu_s_per_token / speedup


def decode_seconds(co: tuple[float, float, float], b: int, kv: float, steps: float) -> float:
    """Seconds for `b` running sequences holding `kv` context tokens in all to advance `steps`
    tokens each, with `co = Setup.decode_coefficients()`."""
    t0, c, k = co
    return (t0 + c * b + k * kv) * steps + 0.5 * k * b * steps * steps


def decode_steps(co: tuple[float, float, float], b: int, kv: float, seconds: float) -> float:
    """Tokens each of `b` running sequences holding `kv` context tokens advances in `seconds`: the
    inverse of `decode_seconds` (the positive root, written to stay exact when `k` is 0)."""
    t0, c, k = co
    a = t0 + c * b + k * kv
    q = 0.5 * k * b
    return 2.0 * seconds / (a + math.sqrt(a * a + 4.0 * q * seconds))


def _coerce(key: str, text: str, current: object) -> object:
    try:
        if isinstance(current, bool):
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            value = float(text)
            if not math.isfinite(value):
                raise ValueError(text)
            return value
        return text
    except ValueError:
        kind = type(current).__name__
        raise ConfigError(f"override {key}={text!r}: expected a {kind}") from None


def apply_overrides(setup: Setup, overrides: list[str]) -> Setup:
    """Apply `key=value` strings; unknown keys and bad values raise ConfigError."""
    names = [f.name for f in dataclasses.fields(Setup) if f.name != "name"]
    changes: dict[str, object] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"override {item!r}: expected key=value")
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"unknown cost-model key {key!r}{hint}")
        changes[key] = _coerce(key, value, getattr(setup, key))
    out = dataclasses.replace(setup, **changes)  # type: ignore[arg-type]
    validate(out)
    return out


def validate(s: Setup) -> None:
    """Cross-field rules, checked at load time."""
    positive = (
        "gpus",
        "groups_per_step",
        "group_size",
        "steps",
        "gpus_per_instance",
        "max_seqs",
        "controller_instances",
    )
    for key in positive:
        if getattr(s, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {getattr(s, key)}")
    if s.staleness < 0:
        raise ConfigError(f"staleness must be >= 0, got {s.staleness}")
    if not 0 <= s.warmup_steps < s.steps:
        raise ConfigError(f"warmup_steps must be in [0, steps), got {s.warmup_steps}")
    if not 0 < s.rollout_gpus < s.gpus:
        raise ConfigError(f"rollout_gpus must be in (0, gpus={s.gpus}), got {s.rollout_gpus}")
    if s.group_size > s.max_seqs:
        raise ConfigError(
            f"group_size {s.group_size} exceeds max_seqs {s.max_seqs}: a group starts on one"
            " instance"
        )
    if s.pool_instances < 0:
        raise ConfigError(f"pool_instances must be >= 0, got {s.pool_instances}")
    if not 0 <= s.train_parallel_efficiency <= 1:
        raise ConfigError(
            f"train_parallel_efficiency must be in [0, 1], got {s.train_parallel_efficiency}"
        )
    if s.turns < 1:
        raise ConfigError(f"turns must be >= 1, got {s.turns}")
    if not 0 <= s.group_share <= 1:
        raise ConfigError(f"group_share must be in [0, 1], got {s.group_share}")
    _ = s.kv_capacity_tokens  # raises if the weights do not fit
