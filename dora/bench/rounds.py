"""dora's throughput over each baseline's, round by round, for `dora bench modes --repeats N`.

The runs of one round follow each other within a few minutes, so the host's speed, which drifts
by 10-30% over longer spans on a shared machine, is nearly the same for all of them. A ratio of
two runs of the same round compares the modes; the ratio of two medians taken over different
rounds also compares the rounds. Printed beside the medians, the per-round ratios show how much
of a ratio is the modes and how much the host.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Protocol


class _Run(Protocol):
    @property
    def tokens_per_s(self) -> float: ...


def round_ratios(runs: Mapping[str, Sequence[_Run]], baseline: str) -> list[float]:
    """dora's tokens/s over `baseline`'s in each round both ran (runs in round order)."""
    pairs = zip(runs.get("dora", ()), runs.get(baseline, ()), strict=False)
    return [d.tokens_per_s / b.tokens_per_s for d, b in pairs if b.tokens_per_s > 0]


def round_ratio_lines(runs: Mapping[str, Sequence[_Run]]) -> list[str]:
    """One line per baseline: dora's ratio in every round, and their median."""
    lines = []
    for baseline in runs:
        ratios = round_ratios(runs, baseline) if baseline != "dora" else []
        if ratios:
            each = ", ".join(f"{r:.2f}" for r in ratios)
            median = statistics.median(ratios)
            lines.append(f"  dora/{baseline} per round: {each} (median {median:.2f})")
    return lines
