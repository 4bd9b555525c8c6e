"""The rules that span several settings, checked when a config is loaded (after the mode presets)
and listed in docs/config.md from the same data, so the reference and the check cannot drift."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dora.net import is_loopback

if TYPE_CHECKING:
    from dora.config import DoraConfig

__all__ = ["CROSS_FIELD_RULES", "SAFE_ON_RESUME", "CrossFieldRule", "safe_on_resume"]


@dataclass(frozen=True)
class CrossFieldRule:
    """A rule over several settings: `text` is what docs/config.md states, `violation` the error
    message for a config that breaks it (None when it holds)."""

    text: str
    violation: Callable[[DoraConfig], str | None]


def _group_too_small(c: DoraConfig) -> str | None:
    if c.rollout.group_size >= 2 or c.learn.loss not in ("grpo", "dr_grpo", "gspo"):
        return None
    return (
        f"rollout.group_size = {c.rollout.group_size} is invalid: group-relative advantages "
        "need at least 2 samples per group"
    )


def _group_over_instance(c: DoraConfig) -> str | None:
    if c.rollout.group_size <= c.serve.max_running:
        return None
    return (
        f"rollout.group_size = {c.rollout.group_size} is invalid: it must be at most "
        f"serve.max_running = {c.serve.max_running}, because a group's samples start "
        "together on one instance"
    )


def _updates_over_batch(c: DoraConfig) -> str | None:
    if c.learn.updates_per_step <= c.rollout.batch_size:
        return None
    return (
        f"learn.updates_per_step = {c.learn.updates_per_step} is invalid: it must be at "
        f"most rollout.batch_size = {c.rollout.batch_size} (each update needs at least one group)"
    )


def _open_without_token(c: DoraConfig) -> str | None:
    if is_loopback(c.serve.host) or c.serve.token:
        return None
    return (
        f"serve.host = {c.serve.host!r} is off loopback: set serve.token so that control "
        "endpoints and the trainer link are authenticated (the link also needs "
        "serve.link_server_key and serve.link_client_key)"
    )


def _inflight_backend(c: DoraConfig) -> str | None:
    if c.rollout.mode != "inflight" or c.serve.backend != "vllm":
        return None
    return (
        "rollout.mode = 'inflight' is invalid with serve.backend = 'vllm': its requests would "
        "have to keep running across a weight load and say which version sampled each token, "
        "which dora's vLLM client cannot; use serve.backend = 'embedded', or rollout.mode = "
        "'partial' (requests resume on the new version by resubmission)"
    )


def _nccl_transport(c: DoraConfig) -> str | None:
    if c.learn.weight_transport != "nccl":
        return None
    why = None
    if c.serve.backend != "vllm":
        why = (
            f"serve.backend = {c.serve.backend!r}: the broadcast goes to vLLM's weight-transfer "
            "workers; set serve.backend = 'vllm'"
        )
    elif c.model.lora.rank > 0:
        why = (
            f"model.lora.rank = {c.model.lora.rank}: a version is then an adapter that vLLM loads "
            "by name, while the broadcast replaces the base weights"
        )
    elif c.emulate.trainer:
        why = "emulate.trainer = true: the emulated trainer has no weights to broadcast"
    if why is None:
        return None
    return (
        f"learn.weight_transport = 'nccl' is invalid with {why} (or learn.weight_transport = "
        "'inline': every version then loads from the weight store)"
    )


def _band_inverted(c: DoraConfig) -> str | None:
    for key, band in (("learn.icepop", c.learn.icepop), ("learn.mis", c.learn.mis)):
        if band.low >= band.high:
            return (
                f"{key}.low = {band.low} is invalid: it must be below {key}.high = {band.high} "
                "(the band of importance ratios a correction keeps)"
            )
    return None


def _greedy_repeats(c: DoraConfig) -> str | None:
    if c.data.eval_samples == 1 or c.data.eval_temperature > 0:
        return None
    return (
        f"data.eval_samples = {c.data.eval_samples} is invalid with data.eval_temperature = 0: "
        "greedy decoding gives every episode of a task the same answer; set "
        "data.eval_temperature (0.6, say) or data.eval_samples = 1"
    )


CROSS_FIELD_RULES: tuple[CrossFieldRule, ...] = (
    CrossFieldRule(
        "`rollout.group_size` >= 2 with the group-relative losses (`grpo`, `dr_grpo`, `gspo`)",
        _group_too_small,
    ),
    CrossFieldRule(
        "`rollout.group_size` <= `serve.max_running`: a group starts together on one instance",
        _group_over_instance,
    ),
    CrossFieldRule(
        "`learn.updates_per_step` <= `rollout.batch_size`: each update needs at least one group",
        _updates_over_batch,
    ),
    CrossFieldRule(
        "`serve.host` off loopback needs `serve.token` (and the link's CURVE keys)",
        _open_without_token,
    ),
    CrossFieldRule(
        "`rollout.mode = 'inflight'` needs a backend that loads under running requests "
        "(`embedded` or `emulated`, not `vllm`)",
        _inflight_backend,
    ),
    CrossFieldRule(
        "`learn.weight_transport = 'nccl'` needs `serve.backend = 'vllm'` (so any mode but "
        "`inflight`), no LoRA and a real trainer",
        _nccl_transport,
    ),
    CrossFieldRule(
        "`learn.icepop.low` < `learn.icepop.high` and `learn.mis.low` < `learn.mis.high`",
        _band_inverted,
    ),
    CrossFieldRule(
        "`data.eval_samples` > 1 needs `data.eval_temperature` > 0",
        _greedy_repeats,
    ),
)
"""Checked in this order at load, after the mode presets; the first broken rule is the error."""


SAFE_ON_RESUME: tuple[str, ...] = (
    "serve",
    "log",
    "run",
    "rollout.tool_timeout_s",
    "learn.threads",
    "learn.recv_timeout_s",
    "learn.checkpoint_every",
    "learn.max_minutes",
    "learn.micro_batch_tokens",
    "learn.shared_prefix",
    "learn.shared_prefix_tokens",
    "learn.weight_transport",
    "data.eval_source",
    "data.eval_split",
    "data.eval_kwargs",
    "data.eval_size",
    "data.eval_every",
    "data.eval_every_s",
    "data.eval_success_at",
    "data.eval_temperature",
    "data.eval_samples",
)
"""Keys (or whole sections and tables) a resume may change; every other key defines the run."""


def safe_on_resume(key: str) -> bool:
    return any(key == safe or key.startswith(f"{safe}.") for safe in SAFE_ON_RESUME)
