"""What the emulated cluster's two sides share: the cost model and where the instances' URLs go.

Imported by the emulated instances (`dora.emulated.cluster`), by serve, which starts them
(`dora.serve.emulated_cluster`), and by the emulated trainer (`dora.learn.emulated_trainer`): it
imports nothing of either side, so both may depend on it.
"""

from __future__ import annotations

from pathlib import Path

from dora.config import DoraConfig
from dora.costs import Setup, apply_overrides, preset

__all__ = ["emulated_setup", "urls_path"]


def urls_path(run_dir: Path) -> Path:
    """The file listing the instances' URLs, one a line, in the run directory."""
    return run_dir / "emulated-urls.txt"


def emulated_setup(config: DoraConfig) -> Setup:
    """The cost model of `emulate.preset` with `emulate.overrides` (one source of truth)."""
    return apply_overrides(preset(config.emulate.preset), list(config.emulate.overrides))
