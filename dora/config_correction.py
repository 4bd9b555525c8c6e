"""The thresholds of the off-policy corrections that `learn.off_policy` chooses from
(`dora.learn.loss` applies them): `[learn.icepop]` and `[learn.mis]`.

Kept apart from dora/config.py so that the menu of corrections reads as one piece; the sections
are plain config sections like the others (validated, listed in docs/config.md). That a low
threshold lies below its high one is a cross-field rule (dora/config_rules.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

M = msgspec.Meta


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
