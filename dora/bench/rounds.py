"""dora's throughput over each baseline's, round by round, for `dora bench modes --repeats N`.

The runs of one round follow each other within a few minutes, so the host's speed, which drifts
by 10-30% over longer spans on a shared machine, is nearly the same for all of them. A ratio of
two runs of the same round compares the modes; the ratio of two medians taken over different
rounds also compares the rounds. Printed beside the medians, the per-round ratios show how much
of a ratio is the modes and how much the host.

The machine's bound is read the same way: each round's bound is the cores over the cheapest CPU
cost per trained token of that round's runs, so dora's share of it compares runs made at the same
host speed. The bound over every run (`dora.bench.modes_report.machine_bound`) takes the cheapest
of all the rounds; it rises with the number of runs, since a minimum over more noisy samples is
lower, and it sets a median run against the fastest moment of the benchmark.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Protocol


class _Run(Protocol):
    @property
    def tokens_per_s(self) -> float: ...

    @property
    def cpu_s_per_token(self) -> float | None: ...


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


def round_bound_shares(runs: Mapping[str, Sequence[_Run]], cores: int) -> list[float]:
    """dora's tokens/s in each round as a share of that round's bound: `cores` busy at the
    lowest CPU-s per trained token of any run of the round (rounds with no such cost: skipped)."""
    shares = []
    for i, dora in enumerate(runs.get("dora", ())):
        costs = [rs[i].cpu_s_per_token for rs in runs.values() if i < len(rs)]
        measured = [c for c in costs if c]
        if measured:
            shares.append(dora.tokens_per_s * min(measured) / cores)
    return shares


def round_bound_line(runs: Mapping[str, Sequence[_Run]], cores: int) -> list[str]:
    """dora's share of each round's bound, and their median (nothing without a measured round)."""
    shares = round_bound_shares(runs, cores)
    if not shares:
        return []
    each = ", ".join(f"{100 * s:.0f}%" for s in shares)
    median = statistics.median(shares)
    return [f"  dora per round: {each} of the round's bound (median {100 * median:.0f}%)"]
