"""`dora simulate`: a discrete-event simulator that drives the real scheduling core (dora/core,
unchanged) with simulated instances and a simulated trainer on a virtual clock.

costs.py holds the cost model and the presets, workload.py the length distributions and agentic
episodes, modes.py the four modes, engine.py the event loop, report.py the tables, JSON and plot,
cli.py the command. docs/simulator.md lists every constant and compares with the DORA paper.
"""

from dora.sim.costs import PRESETS, Setup, apply_overrides, preset
from dora.sim.engine import Run, simulate
from dora.sim.modes import MODES, ModePlan, plan
from dora.sim.report import summarize

__all__ = [
    "MODES",
    "PRESETS",
    "ModePlan",
    "Run",
    "Setup",
    "apply_overrides",
    "plan",
    "preset",
    "simulate",
    "summarize",
]
