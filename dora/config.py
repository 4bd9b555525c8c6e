"""Every setting of a dora run, as msgspec Structs, loaded from TOML or YAML plus dotted overrides.

One top-level `DoraConfig` per file, with the sections `model`, `serve`, `rollout`, `learn`, `env`,
`data`, `log` and `run`. Each field carries its one-line description and its bounds in
`msgspec.Meta`, so the same source feeds validation, `dora config show` and docs/config.md (a test
regenerates the doc and fails if it drifted).

Errors are for people (dora/config_check.py): an unknown key names its path and suggests the
nearest valid key; a wrong type names the key, the value and the expected type; cross-field rules
say what would be valid.

Modes are presets: `sync` forces `rollout.staleness = 0` and `one_step_off` forces 1.
The resolved config (what `dora config show` prints) is what runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from dora.config_check import check_finite, check_keys, explain
from dora.config_file import raw_config
from dora.config_rules import CROSS_FIELD_RULES
from dora.config_sections import IcePopSettings, LoraSettings, MisSettings
from dora.errors import ConfigError
from dora.protocol import MIN_TEMPERATURE

Mode = Literal["sync", "one_step_off", "partial", "dora", "inflight"]
LORA_LR = 1e-5
"""`learn.lr` of a LoRA run that gives none: adapters learn at about ten times the full rate."""
M = msgspec.Meta


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section."""


class ModelConfig(_Section):
    """The policy model."""

    path: Annotated[
        str,
        M(
            description="Hugging Face model folder (a relative path is taken from the working "
            "directory), or 'tiny' to build the tiny character model"
        ),
    ] = "tiny"
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"], M(description="Weights dtype for training")
    ] = "float32"
    tiny_hidden_size: Annotated[int, M(ge=16, description="Hidden size when path = 'tiny'")] = 128
    tiny_layers: Annotated[int, M(ge=1, description="Layers when path = 'tiny'")] = 2
    max_model_len: Annotated[
        int, M(ge=16, description="Context limit in tokens (prompt plus every turn)")
    ] = 1024
    seed: Annotated[int, M(description="Seed of the tiny model's random initialisation")] = 0
    warmup_steps: Annotated[
        int,
        M(
            ge=0,
            description="Supervised warm-up steps on the env's demonstrations or the tasks' "
            "answers; 0 is off",
        ),
    ] = 0
    warmup_lr: Annotated[float, M(gt=0, description="Learning rate of the warm-up")] = 3e-3
    warmup_batch_size: Annotated[int, M(ge=1, description="Sequences per warm-up step")] = 32
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)


class ServeConfig(_Section):
    """The rollout side: inference instances and the endpoint the trainer connects to."""

    backend: Annotated[
        Literal["embedded", "vllm", "emulated"],
        M(description="Inference backend for the instances ('emulated': modelled time, no model)"),
    ] = "embedded"
    instances: Annotated[
        int, M(ge=1, description="Number of inference instances (DP replicas)")
    ] = 2
    threads_per_instance: Annotated[
        int, M(ge=1, description="torch threads in each embedded instance")
    ] = 1
    max_running: Annotated[
        int, M(ge=1, description="Most sequences an instance decodes at once (its capacity)")
    ] = 64
    cpu_priority: Annotated[
        bool,
        M(
            description="Engine processes serve started step their model under SCHED_IDLE "
            "while they have no call of the oldest version in flight (Linux; no privilege needed)"
        ),
    ] = True
    urls: Annotated[
        list[str], M(description="Attach to instances already running at these URLs (vllm)")
    ] = msgspec.field(default_factory=list)
    host: Annotated[
        str,
        M(
            description="Address the trainer link binds to (off loopback it needs the CURVE keys); "
            "the engines serve starts always bind 127.0.0.1"
        ),
    ] = "127.0.0.1"
    port: Annotated[
        int, M(ge=0, le=65535, description="ZMQ port for the trainer link; 0 picks a free one")
    ] = 0
    token: Annotated[
        str,
        M(
            description="Bearer token of engine control routes and the link hello ('': the run's "
            "secret file in log.run_dir, made by dora run); needed off loopback"
        ),
    ] = ""
    link_server_key: Annotated[
        str,
        M(description="CURVE key of serve's end of the trainer link: key file or Z85 secret"),
    ] = ""
    link_client_key: Annotated[
        str,
        M(description="CURVE key of the trainer's end of the link: key file or Z85 secret"),
    ] = ""
    link_max_message_bytes: Annotated[
        int, M(ge=1 << 16, description="Largest message the trainer link accepts (ZMQ_MAXMSGSIZE)")
    ] = 4 << 30
    vllm_python: Annotated[
        str, M(description="Python of the vLLM virtualenv; '' finds .venv-vllm or DORA_VLLM_PYTHON")
    ] = ""
    vllm_args: Annotated[
        list[str],
        M(description="Extra vLLM server flags, e.g. ['--gpu-memory-utilization', '0.85']"),
    ] = msgspec.field(default_factory=list)
    vllm_devices: Annotated[
        list[str],
        M(
            description="CUDA_VISIBLE_DEVICES of each instance dora starts (vLLM or embedded), "
            "e.g. ['0,1', '2,3']"
        ),
    ] = msgspec.field(default_factory=list)
    vllm_tensor_parallel: Annotated[
        int, M(ge=1, description="Tensor-parallel size of each vLLM instance")
    ] = 1
    gpu_memory_fraction: Annotated[
        float,
        M(
            gt=0,
            le=1,
            description="Share of each GPU's memory a vLLM instance takes (--gpu-memory-"
            "utilization); unset while run.colocate is on: 0.45",
        ),
    ] = 0.9
    enforce_eager: Annotated[
        bool,
        M(description="vLLM without CUDA graphs (--enforce-eager); on the CPU it always is"),
    ] = False
    stage_dir: Annotated[
        str,
        M(description="Folder dora writes and vLLM servers read weights from; '' is a temp dir"),
    ] = ""
    kv_migration: Annotated[
        bool, M(description="Migrate requests with their KV cache when the backend can")
    ] = True
    request_timeout_s: Annotated[
        float, M(gt=0, description="Deadline for one LLM call to an instance")
    ] = 600.0
    weight_load_timeout_s: Annotated[
        float, M(gt=0, description="Deadline for an instance to load a version")
    ] = 120.0
    weight_load_retries: Annotated[
        int, M(ge=0, description="Retries of a weight load that timed out; then a new instance")
    ] = 2
    max_instance_restarts: Annotated[
        int, M(ge=0, description="Dead instances dora serve replaces in one run before it stops")
    ] = 3
    health_timeout_s: Annotated[
        float,
        M(
            ge=0,
            description="An instance silent to health probes this long counts as dead (0: off)",
        ),
    ] = 10.0
    runners: Annotated[
        int, M(ge=0, le=256, description="Episode runner processes serve starts (0: in serve)")
    ] = 0
    runner_port: Annotated[int, M(ge=0, le=65535, description="Runners' port (0: any)")] = 0
    runner_timeout_s: Annotated[
        float, M(gt=0, description="A runner silent this long (no heartbeat) counts as dead")
    ] = 30.0


class RolloutConfig(_Section):
    """How groups are sampled and scheduled."""

    mode: Annotated[
        Mode,
        M(
            description="sync, one_step_off, partial, dora (default) or inflight (docs/"
            "scheduling.md)"
        ),
    ] = "dora"
    staleness: Annotated[
        int, M(ge=0, le=64, description="K: most steps between sampling and training a group")
    ] = 2
    group_size: Annotated[int, M(ge=1, description="G: samples per prompt (one GRPO group)")] = 8
    batch_size: Annotated[int, M(ge=1, description="B: groups per train step")] = 4
    max_tokens: Annotated[
        int, M(ge=1, description="Most tokens the policy samples in one episode, all turns")
    ] = 256
    max_tokens_per_turn: Annotated[
        int,
        M(ge=0, description="Most tokens the policy samples in one turn (0: only max_tokens)"),
    ] = 0
    temperature: Annotated[
        float,
        M(ge=MIN_TEMPERATURE, description="Sampling temperature (lower underflows: NaN logprobs)"),
    ] = 1.0
    top_p: Annotated[
        float, M(gt=0, le=1, description="Nucleus sampling; keep 1 for unbiased training")
    ] = 1.0
    max_turns: Annotated[int, M(ge=1, description="Most assistant turns in one episode")] = 8
    tool_timeout_s: Annotated[float, M(gt=0, description="Deadline for one tool call")] = 30.0
    admit_old_versions: Annotated[
        bool, M(description="Let old versions start new groups too (off: newest only)")
    ] = False
    on_env_error: Annotated[
        Literal["mask", "retry"],
        M(description="A failed episode: mask its sample, or retry its group at the same version"),
    ] = "mask"
    max_retries: Annotated[int, M(ge=0, description="Retries of a failed group before masking")] = 2


class LearnConfig(_Section):
    """The trainer."""

    steps: Annotated[int, M(ge=1, description="T: train steps in the run")] = 20
    lr: Annotated[
        float,
        M(
            gt=0,
            description="Learning rate of AdamW (betas 0.9 and 0.999, eps 1e-8), constant: no "
            f"schedule, no warm-up; unset with model.lora.rank > 0: {LORA_LR:g}",
        ),
    ] = 1e-6
    weight_decay: Annotated[float, M(ge=0, description="AdamW weight decay")] = 0.0
    grad_clip: Annotated[float, M(gt=0, description="Max gradient norm")] = 1.0
    updates_per_step: Annotated[
        int, M(ge=1, description="Optimizer updates per step (mini-batches of the B groups)")
    ] = 1
    processes: Annotated[
        int, M(ge=1, description="Trainer ranks dora learn starts itself (torchrun; gloo on CPU)")
    ] = 1
    devices: Annotated[
        str,
        M(
            description="CUDA_VISIBLE_DEVICES of the trainer, one GPU per rank, e.g. '4,5,6,7'; "
            "'' plans it (docs/gpu.md)"
        ),
    ] = ""
    strategy: Annotated[
        Literal["ddp", "fsdp"],
        M(description="How ranks share the model: ddp (a whole copy each) or fsdp (FSDP2 shards)"),
    ] = "ddp"
    threads: Annotated[int, M(ge=1, description="torch threads per trainer rank")] = 1
    loss: Annotated[
        Literal["grpo", "dr_grpo", "gspo"], M(description="Policy-gradient objective")
    ] = "grpo"
    aggregation: Annotated[
        Literal["token", "sequence"], M(description="Normalise the loss per token or per sequence")
    ] = "token"
    clip_low: Annotated[float, M(ge=0, description="PPO clip below: ratio >= 1 - clip_low")] = 0.2
    clip_high: Annotated[
        float, M(ge=0, description="PPO clip above: ratio <= 1 + clip_high (DAPO clip-higher)")
    ] = 0.28
    off_policy: Annotated[
        Literal["none", "tis", "decoupled", "icepop", "mis"],
        M(
            description="Correction for stale or mismatched behaviour logprobs (docs/trainer.md): "
            "tis truncates token weights, decoupled and icepop mask tokens, mis weighs sequences"
        ),
    ] = "tis"
    tis_cap: Annotated[
        float, M(gt=0, description="Cap of the token weights of tis, and decoupled's mask")
    ] = 2.0
    icepop: IcePopSettings = msgspec.field(default_factory=IcePopSettings)
    mis: MisSettings = msgspec.field(default_factory=MisSettings)
    kl_coef: Annotated[float, M(ge=0, description="KL penalty to the initial policy; 0 is off")] = (
        0.0
    )
    filter_zero_variance: Annotated[
        bool, M(description="Drop groups whose rewards are all equal (DAPO dynamic sampling)")
    ] = False
    micro_batch_tokens: Annotated[
        int, M(ge=16, description="Token budget of one packed micro-batch")
    ] = 8192
    shared_prefix: Annotated[
        bool,
        M(
            description="Run a group's prompt once per micro-batch: its sequences packed in one "
            "row (SDPA attention by segments, eager under a 4D mask); false: one padded row each"
        ),
    ] = True
    shared_prefix_tokens: Annotated[
        int,
        M(
            ge=16,
            description="Longest packed row: a group that needs more such rows than padded "
            "micro-batches trains padded (a row's masked attention grows with its square)",
        ),
    ] = 1024
    recv_timeout_s: Annotated[
        float, M(gt=0, description="Deadline for dora serve's next message to the trainer")
    ] = 600.0
    checkpoint_every: Annotated[
        int, M(ge=1, description="Steps between checkpoints (one is always written at the end)")
    ] = 10
    weight_transport: Annotated[
        Literal["filesystem", "inline", "nccl"],
        M(
            description="How versions reach dora serve; 'nccl' sends them inline and broadcasts "
            "each from rank 0's GPU to the vLLM instances that switch to it (docs/vllm.md)"
        ),
    ] = "inline"
    nccl_address: Annotated[
        str, M(description="Rank 0's address as the vLLM workers reach it, for the NCCL group")
    ] = "127.0.0.1"
    nccl_port: Annotated[
        int, M(ge=0, le=65535, description="Port rank 0 opens the NCCL group on; 0 picks one")
    ] = 0
    seed: Annotated[int, M(description="Seed of the trainer")] = 0
    max_minutes: Annotated[
        float,
        M(
            ge=0,
            description="Time budget: the run ends at the first step boundary after this many "
            "minutes (from serve's start), checkpointed and evaluated; 0 is off",
        ),
    ] = 0.0


class EnvConfig(_Section):
    """The environment class episodes run in."""

    cls: Annotated[
        str,
        M(
            description="'module:Class' of the environment, e.g. 'envs.math:ChainArithmeticEnv' "
            "(imported from the working directory, PYTHONPATH or installed packages)"
        ),
    ] = "envs.math:ChainArithmeticEnv"
    kwargs: Annotated[
        dict[str, str | int | float | bool | list[str | int | float]],
        M(description="Keyword arguments for the environment's constructor"),
    ] = msgspec.field(default_factory=dict)
    prompt_special_tokens: Annotated[
        bool,
        M(
            description="A plain-text prompt is tokenizer(prompt) with the tokenizer's special "
            "tokens (a base model's BOS); false encodes it without them"
        ),
    ] = True
    step_timeout_s: Annotated[
        float,
        M(
            gt=0,
            le=86400,
            description="Deadline for each call of reset, tools and step; past it the episode "
            "is masked ('step timed out after ...')",
        ),
    ] = 300.0
    reward_timeout_s: Annotated[
        float,
        M(
            gt=0,
            le=86400,
            description="Deadline for reward; past it the episode is masked "
            "('reward timed out after ...')",
        ),
    ] = 120.0
    episode_timeout_s: Annotated[
        float,
        M(
            ge=0,
            le=86400,
            description="Deadline for a whole episode, LLM calls included; past it the episode is "
            "masked; 0: none (each hook and LLM call has its own)",
        ),
    ] = 0.0


class DataConfig(_Section):
    """Where tasks come from and how evaluation samples them."""

    source: Annotated[
        str,
        M(
            description="Tasks: 'env' (the environment's own, Env.tasks), a .jsonl/.json/.parquet "
            "file (relative to the working directory), or 'module:function' (imported like env.cls)"
        ),
    ] = "env"
    split: Annotated[
        str, M(description="The environment's task split to train on, when source is 'env'")
    ] = "train"
    kwargs: Annotated[
        dict[str, str | int | float | bool | list[str | int | float]],
        M(description="Keyword arguments of the task function (source 'env' or a function)"),
    ] = msgspec.field(default_factory=dict)
    seed: Annotated[int, M(description="Seed of the prompt stream (reshuffled every epoch)")] = 0
    shuffle: Annotated[
        bool, M(description="Shuffle the prompt stream every epoch; false keeps the source's order")
    ] = True
    eval_source: Annotated[
        str, M(description="Held-out tasks, like source; '' turns evaluation off")
    ] = ""
    eval_split: Annotated[
        str, M(description="The environment's held-out split, when eval_source is 'env'")
    ] = "test"
    eval_kwargs: Annotated[
        dict[str, str | int | float | bool | list[str | int | float]],
        M(description="Keyword arguments of the held-out task function"),
    ] = msgspec.field(default_factory=dict)
    eval_size: Annotated[int, M(ge=0, description="Held-out tasks per evaluation; 0 is off")] = 64
    eval_every: Annotated[
        int, M(ge=0, description="Steps between evaluations; 0: only by eval_every_s")
    ] = 5
    eval_every_s: Annotated[
        float,
        M(
            ge=0,
            description="Also evaluate every this many seconds of the run (when a version "
            "trained that late is loaded); 0 is off",
        ),
    ] = 0.0
    eval_success_at: Annotated[
        float,
        M(
            description="A held-out episode is a success when its reward is at least this: "
            "`accuracy` is the fraction of successes (the math environments score 1.0 right)"
        ),
    ] = 1.0
    eval_temperature: Annotated[
        float,
        M(
            ge=0,
            description="Sampling temperature of held-out episodes; 0 decodes greedily",
        ),
    ] = 0.0
    eval_samples: Annotated[
        int,
        M(
            ge=1,
            description="Episodes per held-out task: `accuracy` is their mean success (avg@k), "
            "`pass_at_k` the share of tasks with at least one success; more than 1 needs "
            "eval_temperature > 0",
        ),
    ] = 1


class LogConfig(_Section):
    """Where a run writes, and what it shows."""

    run_dir: Annotated[str, M(description="Run directory; '' makes runs/<name>-<timestamp>")] = ""
    name: Annotated[str, M(description="Run name")] = "dora"
    metrics_every_s: Annotated[
        float, M(gt=0, description="Seconds between periodic metric records")
    ] = 1.0
    progress: Annotated[bool, M(description="Show a live progress display in the terminal")] = True
    console_every: Annotated[
        int,
        M(ge=0, description="Print a line (reward, loss, tokens/s, ...) every N steps; 0 is off"),
    ] = 1
    samples_every: Annotated[
        int,
        M(
            ge=0,
            description="Write one completed group in every N to samples.jsonl in the run "
            "directory (token ids, text, rewards); 0 is off",
        ),
    ] = 0
    tensorboard: Annotated[
        bool,
        M(description="Also log metrics to TensorBoard in <run_dir>/tensorboard (extra: tracking)"),
    ] = False
    wandb: Annotated[
        bool,
        M(description="Also log metrics to Weights & Biases, project 'dora' (extra: tracking)"),
    ] = False
    trackio: Annotated[
        bool,
        M(description="Also log metrics to trackio, project 'dora' (pip install trackio)"),
    ] = False


class RunConfig(_Section):
    """`dora run`: how it keeps serve and learn going."""

    max_restarts: Annotated[
        int,
        M(
            ge=0,
            description="Restarts of each side that dies (serve; learn, with --resume) before "
            "dora run stops",
        ),
    ] = 3
    colocate: Annotated[
        bool,
        M(
            description="The trainer shares the inference instances' GPUs (vLLM then takes "
            "serve.gpu_memory_fraction of each); off: disjoint GPUs"
        ),
    ] = False


class EmulateConfig(_Section):
    """Emulated accelerators (`serve.backend = "emulated"`, `emulate.trainer`): the simulator's
    cost model spent as scaled time instead of compute (docs/emulation.md)."""

    preset: Annotated[
        str, M(description="Cost-model preset of dora.sim (paper-64, paper-128, agentic)")
    ] = "paper-64"
    overrides: Annotated[
        list[str], M(description="Cost-model key=value overrides, as `dora simulate` takes them")
    ] = msgspec.field(default_factory=list)
    time_scale: Annotated[
        float, M(gt=0, description="Real seconds per modelled second (0.02: 50x faster)")
    ] = 0.02
    seed: Annotated[int, M(description="Seed of the emulated model's response lengths")] = 0
    trainer: Annotated[
        bool, M(description="dora learn spends modelled training time instead of compute")
    ] = False
    train_gpus: Annotated[
        int, M(ge=0, description="GPUs the emulated trainer has; 0: the preset's trainer pool")
    ] = 0
    stream_training: Annotated[
        bool, M(description="The emulated trainer works on groups as they arrive (off: at close)")
    ] = True
    colocated: Annotated[
        bool,
        M(description="The emulated trainer pauses the instances while it trains (shared GPUs)"),
    ] = False


class DoraConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A whole run."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    serve: ServeConfig = msgspec.field(default_factory=ServeConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    learn: LearnConfig = msgspec.field(default_factory=LearnConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    emulate: EmulateConfig = msgspec.field(default_factory=EmulateConfig)


MODE_STALENESS: dict[str, int] = {"sync": 0, "one_step_off": 1}


# --- loading ----------------------------------------------------------------------------------


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> DoraConfig:
    """Load a TOML or YAML file, apply `key=value` overrides, validate, resolve mode presets."""
    return config_from_raw(raw_config(path, overrides))


def config_from_raw(raw: Mapping[str, object]) -> DoraConfig:
    """The resolved config of a config as written (`dora.config_file.raw_config`)."""
    check_keys(raw, DoraConfig, prefix="")
    try:
        config = msgspec.convert(raw, DoraConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(explain(exc, raw, DoraConfig)) from None
    learn = raw.get("learn")
    if config.model.lora.rank and not (isinstance(learn, dict) and "lr" in learn):
        config = msgspec.structs.replace(
            config, learn=msgspec.structs.replace(config.learn, lr=LORA_LR)
        )
    return _resolve(config)


def _resolve(config: DoraConfig) -> DoraConfig:
    """Apply mode presets and check rules that span fields."""
    check_finite(config, prefix="")
    rollout = config.rollout
    if rollout.mode in MODE_STALENESS:
        rollout = msgspec.structs.replace(rollout, staleness=MODE_STALENESS[rollout.mode])
        config = msgspec.structs.replace(config, rollout=rollout)
    for rule in CROSS_FIELD_RULES:
        problem = rule.violation(config)
        if problem:
            raise ConfigError(problem)
    return config
