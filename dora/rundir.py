"""Where a run keeps its files: `log.run_dir`, or a fresh `runs/<log.name>-<stamp>` folder.

`dora serve` and `dora learn` resolve it alike; a resumed run must name its folder (there is no
newest-folder guess that could continue the wrong run).
"""

from __future__ import annotations

import time
from pathlib import Path

from dora.config import DoraConfig
from dora.errors import ConfigError

__all__ = ["resolve_run_dir"]


def resolve_run_dir(config: DoraConfig, *, resume: bool) -> Path:
    if config.log.run_dir:
        return Path(config.log.run_dir).resolve()
    if resume:
        raise ConfigError("--resume needs log.run_dir: the run directory to continue")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs", f"{config.log.name}-{stamp}").resolve()
