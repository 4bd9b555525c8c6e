"""dora's ratio over each baseline within each round of `dora bench modes --repeats N`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dora.bench.rounds import (
    round_bound_line,
    round_bound_shares,
    round_ratio_lines,
    round_ratios,
)


@dataclass
class Run:
    tokens_per_s: float
    cpu_s_per_token: float | None = None


def test_each_round_pairs_the_runs_it_made() -> None:
    """A host twice as fast in round 1 moves both modes; the per-round ratio does not move,
    where the ratio of the medians mixes rounds."""
    runs = {
        "sync": [Run(1000.0), Run(2000.0), Run(1100.0)],
        "dora": [Run(1500.0), Run(3000.0), Run(1650.0)],
        "partial": [Run(1200.0), Run(0.0)],  # a round it did not finish, and one it skipped
    }
    assert round_ratios(runs, "sync") == [1.5, 1.5, 1.5]
    assert round_ratios(runs, "partial") == [1.25]
    assert round_ratio_lines(runs) == [
        "  dora/sync per round: 1.50, 1.50, 1.50 (median 1.50)",
        "  dora/partial per round: 1.25 (median 1.25)",
    ]
    assert round_ratio_lines({"sync": runs["sync"]}) == []  # no dora run, no ratio


def test_each_round_has_its_own_bound() -> None:
    """Round 1 ran on a host twice as fast: its cheapest token sets its own bound, not round 0's;
    and the bound is the round's cheapest token of any mode, not dora's own."""
    runs = {
        "sync": [Run(1000.0, 0.0009), Run(2000.0, 0.0005)],
        "dora": [Run(1800.0, 0.0010), Run(3600.0, 0.0005)],
        "partial": [Run(1200.0, None)],  # no CPU sample: no cost, no bound of its own
    }
    assert round_bound_shares(runs, 2) == pytest.approx([0.81, 0.9])
    assert round_bound_line(runs, 2) == [
        "  dora per round: 81%, 90% of the round's bound (median 86%)"
    ]
    unmeasured = {"dora": [Run(1800.0, None)], "sync": [Run(1000.0, None)]}
    assert round_bound_line(unmeasured, 2) == []
