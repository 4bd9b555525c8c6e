"""The five rollout modes as the simulator runs them: presets of one machinery (docs/scheduling.md).

Each mode is a staleness bound K for the transfer queue, an orchestrator mode, and a placement:

| mode | K | orchestrator | placement |
| --- | --- | --- | --- |
| sync | 0 | SYNC | colocated: every GPU generates, then every GPU trains |
| one_step_off | 1 | ONE_STEP_OFF | disaggregated (`rollout_gpus` generate, the rest train) |
| partial | K | PARTIAL | colocated, as the paper ran it (`partial_colocated=0`: disaggregated) |
| dora | K | DORA | disaggregated |
| inflight | K | INFLIGHT | disaggregated; each new version loaded under running requests |
"""

from __future__ import annotations

from dataclasses import dataclass

from dora.core.orchestrator import Mode
from dora.costs import Setup
from dora.errors import ConfigError

__all__ = ["MODES", "PAPER_MODES", "ModePlan", "plan"]

PAPER_MODES = ("sync", "one_step_off", "partial", "dora")
"""The modes the DORA paper compares (its baselines and dora), which `dora bench cluster` runs."""
MODES = (*PAPER_MODES, "inflight")


@dataclass(frozen=True, slots=True)
class ModePlan:
    name: str
    staleness: int
    orchestrator: Mode
    colocated: bool
    instances: int
    train_gpus: int


def plan(name: str, setup: Setup) -> ModePlan:
    if name == "sync":
        return ModePlan(name, 0, Mode.SYNC, True, setup.colocated_instances, setup.gpus)
    if name == "one_step_off":
        return ModePlan(name, 1, Mode.ONE_STEP_OFF, False, setup.instances, setup.train_gpus)
    if name == "partial":
        if setup.partial_colocated:
            return ModePlan(
                name, setup.staleness, Mode.PARTIAL, True, setup.colocated_instances, setup.gpus
            )
        return ModePlan(
            name, setup.staleness, Mode.PARTIAL, False, setup.instances, setup.train_gpus
        )
    if name == "dora":
        return ModePlan(name, setup.staleness, Mode.DORA, False, setup.instances, setup.train_gpus)
    if name == "inflight":
        return ModePlan(
            name, setup.staleness, Mode.INFLIGHT, False, setup.instances, setup.train_gpus
        )
    raise ConfigError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
