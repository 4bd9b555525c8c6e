"""The simulated trainer: which groups each train step holds, and when the trainer trains them.

The event loop (events.py) hands over every group the transfer queue assigns to a step; this book
counts it into its step and keeps the trainer's busy spans on the virtual clock. When the trainer
trains follows the mode: a colocated mode trains a step once it is full, on every GPU; a
disaggregated one with `stream_training` trains each group as it arrives (a step ends with the
last one's), else the whole step once it is full. Every step ends with `train_step_overhead_s`.
A finished step's record (tokens, groups, versions, the longest episode chain) goes into the
`Run` when the event loop reaches the step's end.
"""

from __future__ import annotations

from collections import Counter

from dora.core import Assigned
from dora.costs import Setup
from dora.errors import SchedulingError
from dora.sim.modes import ModePlan
from dora.sim.state import Group, Run

__all__ = ["Steps"]

_EPS = 1e-7


class Steps:
    """The groups of every train step as they arrive, and the trainer's time."""

    def __init__(self, setup: Setup, plan: ModePlan, run: Run) -> None:
        self.s = setup
        self.p = plan
        self.run = run
        self.count = [0] * setup.steps
        self.tokens = [0] * setup.steps
        self.chain: list[Group | None] = [None] * setup.steps  # each step's longest chain
        self.versions: list[Counter[int]] = [Counter() for _ in range(setup.steps)]
        self.until = 0.0
        """When the trainer is done with all it has been given."""

    def take(self, a: Assigned, group: Group, now: float) -> float | None:
        """Count `group` into step `a.step` and train what the mode trains now: when that fills
        the step, the time its training ends (else None)."""
        s, k, tokens = self.s, self.p.staleness, group.tokens
        top = self.chain[a.step]
        if top is None or group.chain_s > top.chain_s:
            self.chain[a.step] = group
        stale = a.step - a.version
        if not 0 <= stale <= k:
            raise SchedulingError(f"staleness {stale} outside [0, {k}] for {a}")
        self.run.staleness.append(stale)
        self.count[a.step] += 1
        self.tokens[a.step] += tokens
        self.versions[a.step][a.version] += 1
        full = self.count[a.step] == s.groups_per_step
        gpus = self.p.train_gpus
        if not self.p.colocated and s.stream_training:
            self._train(max(self.until, now), s.train_s(tokens, gpus))
        elif full:
            self._train(max(self.until, now), s.train_s(self.tokens[a.step], gpus))
        if not full:
            return None
        self._train(self.until, s.train_step_overhead_s)
        return self.until

    def record(self, step: int) -> None:
        """Add finished step `step`'s tokens, groups, versions and longest chain to the run."""
        run = self.run
        run.step_tokens.append(self.tokens[step])
        top = self.chain[step]
        assert top is not None
        run.step_chain_s.append(top.chain_s)
        run.step_chain_group.append((top.version, top.admitted_s, top.done_s))
        run.step_groups.append(self.count[step])
        run.step_versions.append(dict(self.versions[step]))

    def _train(self, start: float, work: float) -> None:
        spans = self.run.trainer
        if spans and start <= spans[-1][1] + _EPS:
            spans[-1][1] = start + work
        else:
            spans.append([start, start + work])
        self.until = start + work
