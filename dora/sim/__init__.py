"""`dora simulate`: a discrete-event simulator that drives the real scheduling core (dora/core,
unchanged) with simulated instances and a simulated trainer on a virtual clock.

The cost model and its presets are `dora.costs`; workload.py holds the length distributions and
agentic episodes, modes.py the modes, events.py the event loop and its instances, steps.py the
trainer, report.py the tables, JSON and plot, main.py the command, calibrate.py the fit of the
calibrated constants on the paper's synchronous baseline. docs/simulator.md lists every constant
and compares with the DORA paper.
"""

from dora.sim.events import Run, simulate
from dora.sim.modes import MODES, ModePlan, plan
from dora.sim.report import summarize

__all__ = ["MODES", "ModePlan", "Run", "plan", "simulate", "summarize"]
