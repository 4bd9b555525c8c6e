"""The cost model that the simulator (`dora.sim`), the emulated instances and the emulated
trainer (`dora.emulated`) all spend: `model.py` holds the `Setup` and its formulas, `presets.py`
the named setups as plain data. It imports nothing of dora but the errors, so every layer above
may read it; the calibration that measured the `cpu-bench` preset lives in `dora.bench`.
"""

from dora.costs.model import Setup, apply_overrides, decode_seconds, decode_steps, validate
from dora.costs.presets import PRESETS, preset

__all__ = [
    "PRESETS",
    "Setup",
    "apply_overrides",
    "decode_seconds",
    "decode_steps",
    "preset",
    "validate",
]
