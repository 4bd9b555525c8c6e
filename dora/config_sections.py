"""The config sections that sit inside another section: `[model.lora]`, and the thresholds of
the off-policy corrections that `learn.off_policy` chooses from (`dora.learn.loss` applies them):
`[learn.icepop]` and `[learn.mis]`.

They are plain config sections like the others (validated, listed in docs/config.md); the menu of
corrections reads as one piece here. That a low threshold lies below its high one is a cross-field
rule (dora/config_rules.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

M = msgspec.Meta

_LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """LoRA adapters: the trainer trains only them and every published version is one."""

    rank: Annotated[
        int, M(ge=0, description="LoRA rank r; 0 trains every weight (no adapters)")
    ] = 0
    alpha: Annotated[
        int, M(ge=1, description="LoRA alpha: the adapter's update is scaled by alpha / rank")
    ] = 16
    dropout: Annotated[
        float,
        M(
            ge=0,
            lt=1,
            description="Dropout on the adapters' input while training (the engine samples "
            "without it, so keep 0 for exact behaviour logprobs)",
        ),
    ] = 0.0
    target_modules: Annotated[
        list[str],
        M(description="Names of the linear layers that get adapters (peft's target_modules)"),
    ] = msgspec.field(default_factory=lambda: list(_LLAMA_LINEARS))


class IcePopSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`learn.off_policy = "icepop"`: a token whose importance ratio pi_prox / mu lies outside
    [low, high] is masked (no gradient); inside the band its ratio is the weight, untruncated."""

    low: Annotated[float, M(ge=0, description="Tokens with a ratio below this are masked")] = 0.5
    high: Annotated[float, M(gt=0, description="Tokens with a ratio above this are masked")] = 5.0


class MisSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`learn.off_policy = "mis"`: one importance weight per sequence, from its tokens' ratios
    pi_prox / mu, applied to each of its tokens."""

    ratio: Annotated[
        Literal["geometric", "product"],
        M(
            description="The sequence's ratio: the geometric mean of its token ratios "
            "(length-neutral) or their product (the exact sequence likelihood ratio)"
        ),
    ] = "geometric"
    action: Annotated[
        Literal["truncate", "mask"],
        M(
            description="A sequence ratio outside [low, high]: clamped into it, or the whole "
            "sequence masked"
        ),
    ] = "truncate"
    low: Annotated[float, M(ge=0, description="Lower bound of the sequence weight")] = 0.0
    high: Annotated[float, M(gt=0, description="Upper bound of the sequence weight")] = 2.0
